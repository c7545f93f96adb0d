"""Hopper Mosaic GPU kernels (`jax.experimental.pallas.mosaic_gpu`).

One kernel per file, each with its wrapper; the backend is picked in
`jaxinfer.ops.attention` / `jaxinfer.ops.linear`.
"""
