"""Kernel ops: for each op a contract module (signature, layouts, weight formats, the pure-JAX
reference) and a registry module (its implementations in preference order, each with a
`supports` predicate; the one place that picks between them).

Kernels (`jaxinfer.pallas_kernels`, `jaxinfer.mosaic`) import contracts only; registries
import kernels. This package's `__init__` imports nothing, so that a kernel importing a
contract does not pull in a registry.
"""
