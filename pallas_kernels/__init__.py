"""Pallas kernels, one per file with its wrapper: the TPU kernels (`pltpu`; run on the CPU in
TPU interpret mode for tests) and one GPU (Triton) lowering, the one-token ragged paged
attention kernel, which runs on Hopper only.

Kernels import only their op's contract (`jaxinfer.ops.<op>`); which kernel runs a call is
decided by the op's registry (`jaxinfer.ops.<op>_registry`), nowhere here.
"""
