"""Hopper Mosaic GPU kernels (`jax.experimental.pallas.mosaic_gpu`), one per file with its
wrapper; they run on the CPU in Mosaic GPU interpret mode for tests.

Kernels import only their op's contract (`jaxinfer.ops.<op>`); which kernel runs a call is
decided by the op's registry (`jaxinfer.ops.<op>_registry`), nowhere here.
"""
