"""Portable Pallas kernels (TPU lowering, GPU lowering for pre-Hopper GPUs).

One kernel per file, each with its wrapper; the backend is picked in
`jaxinfer.ops.attention` / `jaxinfer.ops.linear`.
"""
