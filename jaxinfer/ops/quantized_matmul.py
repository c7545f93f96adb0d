"""Quantized matmul: y = x @ W^T for a `QuantizedWeight` W, the one entry point.

  x  [..., K]  bfloat16 / float16 / float32 activations
  w  QuantizedWeight of W [N, K] (see `jaxinfer.ops.quant`)
  -> [..., N] in x.dtype, accumulated in float32

`quantized_matmul` picks the implementation in one place: the Mosaic GPU kernel
on Hopper, the Pallas TPU kernel on TPU, the pure-JAX reference elsewhere (CPU,
older GPUs, where XLA fuses per-channel dequantisation into the dot). A kernel
that cannot take the inputs (see its `unsupported_reason`) falls back to the
reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.ops.platform import IMPLEMENTATIONS, default_implementation
from jaxinfer.ops.quant import FP8_DTYPE, FP8_MAX, QuantizedWeight, dequantize


def quantize_activations_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [M, K] -> (e4m3 [M, K], float32 per-token scales [M, 1]), x ~ values * scales."""
    absmax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True)
    scales = jnp.where(absmax > 0, absmax / FP8_MAX, 1.0)
    values = jnp.clip(x.astype(jnp.float32) / scales, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return values, scales


def dot_nt(x, w, dtype=jnp.float32):
    """x [M, K] . w [N, K]^T -> [M, N] in dtype."""
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=dtype)


def quantized_matmul_reference(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x [M, K] -> [M, N]: dequantise + dot (XLA fuses the per-channel case into the dot)."""
    if w.activations == "fp8":
        xq, x_scales = quantize_activations_fp8(x)
        y = dot_nt(xq, w.values) * x_scales * w.scales[0]
    elif w.group_size == w.shape[1] and w.offsets is None:
        y = dot_nt(x, w.values.astype(x.dtype)) * w.scales[0]
    else:
        y = dot_nt(x, dequantize(w, x.dtype))
    return y.astype(x.dtype)


def quantized_matmul(x: jax.Array, w: QuantizedWeight, *,
                     implementation: str | None = None) -> jax.Array:
    """x [..., K] @ W^T -> [..., N] in x.dtype (see the module docstring).

    `implementation` forces one of IMPLEMENTATIONS (tests and benchmarks); None
    picks the default for the device, falling back to the reference for inputs
    the kernel does not take.
    """
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"quantized_matmul: x has {x.shape[-1]} features, the weight {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    impl = implementation or default_implementation()
    if impl == "mosaic_gpu":
        from jaxinfer.mosaic.quantized_matmul import (
            MAX_KERNEL_M,
            quantized_matmul_mgpu,
            unsupported_reason,
        )
        # Above MAX_KERNEL_M tokens XLA is faster (see that constant).
        if implementation is None and (x2.shape[0] > MAX_KERNEL_M
                                       or unsupported_reason(x2, w) is not None):
            impl = "reference"
        else:
            y = quantized_matmul_mgpu(x2, w)
    if impl == "pallas_tpu":
        from jaxinfer.pallas_kernels.quantized_matmul import (
            quantized_matmul_tpu,
            unsupported_reason,
        )
        if implementation is None and unsupported_reason(x2, w) is not None:
            impl = "reference"
        else:
            y = quantized_matmul_tpu(x2, w)
    if impl == "reference":
        y = quantized_matmul_reference(x2, w)
    elif impl not in IMPLEMENTATIONS:
        raise ValueError(f"quantized_matmul implementation {impl!r}: "
                         f"expected one of {IMPLEMENTATIONS}")
    return y.reshape(*lead, n)
