"""The one linear-layer entry point: y = x @ W^T (+ b), for float and quantized weights.

Weights are stored (N, K) = (out_features, in_features), K-major: the layout of
HF checkpoints, and the one 8-bit tensor-core operands need (they cannot be
transposed on the fly). A float W is one XLA dot (a multiply and a row reduction
when x is one row, see `linear`); a `QuantizedWeight` (int8 /
int4 / fp8 values with per-group scales, see `jaxinfer.ops.quant`) goes to
`quantized_matmul`, which picks the kernel for the device.
"""

import jax
import jax.numpy as jnp

from jaxinfer.ops.quant import QuantizedWeight
from jaxinfer.ops.quantized_matmul import quantized_matmul

# One-row products over at least this many input features are a multiply-reduce
# (`linear`); below it XLA's dot was faster (SmolLM2's head, K = 576: 16.2 us against 18.1).
ONE_ROW_REDUCE_MIN_K = 1024


def linear(x: jax.Array, weight: jax.Array | QuantizedWeight,
           bias: jax.Array | None = None, row_scale: jax.Array | None = None) -> jax.Array:
    """x [..., K] @ weight [N, K]^T (* row_scale) (+ bias [N]) -> [..., N] in x.dtype
    (f32 accumulation).

    `weight` is a float array or a `QuantizedWeight`; the bias is always float.
    `row_scale` [..., 1] float32 scales each row of the product before the bias: an
    RMSNorm folded into the weight leaves its 1 / rms(x) to be applied here
    (`RMSNorm.fold_into`). The product is then rounded to x.dtype before the scale (as a
    quantized product always is), because XLA does not fuse the scale into the GEMM: a
    float32 product would be written and read back in full (at 64 tokens the gate/up
    product alone is 7.3 MB per layer; bench/NOTES.md, serving engine v5). One float row
    (K >= ONE_ROW_REDUCE_MIN_K) is a reduction, whose float32 product is scaled unrounded.
    """
    if isinstance(weight, QuantizedWeight):
        y = quantized_matmul(x, weight)
    elif x.size == x.shape[-1] and x.shape[-1] >= ONE_ROW_REDUCE_MIN_K:
        # One row (batch-1 decode): a multiply and a row reduction over K, which XLA runs
        # with its reduction emitter in one pass over W: 4.0-4.6 TB/s on an H200 for the
        # Qwen3 / Llama-3 projections and heads of 16 MB or more. As a dot, XLA's
        # autotuner picks cuBLAS or a Triton GEMM anew at each compilation, timing them
        # with W in L2: from HBM up to 2.5x slower (bench/NOTES.md, linear v1).
        w = weight.astype(x.dtype).astype(jnp.float32)  # the dot's operands, exactly
        y = jnp.sum(x.astype(jnp.float32)[..., None, :] * w, axis=-1)
    else:
        y = jax.lax.dot_general(
            x, weight.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())),
            preferred_element_type=jnp.float32 if row_scale is None else x.dtype,
        )
    if bias is None and row_scale is None:
        return y.astype(x.dtype)
    y = y.astype(jnp.float32)
    if row_scale is not None:
        y = y * row_scale
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)
