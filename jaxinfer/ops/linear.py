"""The linear layer: the contract every caller and every implementation shares.

    linear(x, weight, bias=None, row_scale=None, *, rounded=False, prologue=None) -> y

  x          [..., K]  bfloat16 / float16 / float32 activations; with prologue "swiglu"
             [..., 2K], the gate | up halves of a SwiGLU, whose silu(gate) * up
             (`swiglu_halves`: float32, rounded to x.dtype) the product takes
  weight     [N, K]    float (cast to x.dtype), or a `QuantizedWeight` of W [N, K]
                       (`jaxinfer.ops.quant`: int8 / int4 / fp8 values, per-group scales)
  bias       [N]       float (added in float32), or None
  row_scale  [..., 1]  float32, or None: scales each row of the product before the bias
                       (an RMSNorm folded into the weight leaves its 1 / rms(x) here)
  rounded    the float product rounded to x.dtype by the GEMM itself, with no row scale
             either: for a product that a kernel reads (see Rounding)
  -> y = x @ W^T (* row_scale) (+ bias)  [..., N] in x.dtype, accumulated in float32

Weights are stored (N, K) = (out_features, in_features), K-major: the layout of HF
checkpoints, and the one 8-bit tensor-core operands need (they cannot be transposed on
the fly).

Callers use `jaxinfer.ops.linear_registry.linear`, which picks an implementation for the
call (`LinearCall`) and runs it; this module holds what they share: the product forms
(`float_product`, `one_row_product`, `quantized_matmul_reference`), fp8 activation
quantization (W8A8), the SwiGLU prologue (`swiglu_halves`), and the bias / row-scale
epilogue (`linear_epilogue`) that every implementation ends with.

Rounding: a float product is rounded to x.dtype before the row scale (as a quantized
product always is), because XLA does not fuse the scale into the GEMM: a float32 product
would be written and read back in full (at 64 tokens the gate/up product alone is 7.3 MB
per layer; bench/NOTES.md, Serving engine decode loop: Folded projection's product in
bf16). Without a row scale the float32 product is left for XLA to fuse its cast into
whatever reads it (the residual add that follows o and down), unless `rounded`: a kernel
cannot take the cast, which then ran as a kernel of its own (the fused q/k/v projection,
read by the attention's k / v write kernel: bench/NOTES.md, Ragged paged attention: One
pass for the k / v write and q). The values are the same either way. The one-row product
is a reduction whose float32 result is scaled unrounded (XLA fuses its cast).

Prologue: an implementation that does the SwiGLU itself says so (the registry's `fuses`:
W8A8's activation quantization on Hopper, which reads the halves in the same pass);
for the others `linear` applies `swiglu_halves` first, which XLA fuses into one kernel.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxinfer.ops.quant import (
    FP8_DTYPE,
    FP8_MAX,
    QuantizedWeight,
    dequantize,
    from_chunk_order,
)

Weight = jax.Array | QuantizedWeight


PROLOGUES = ("swiglu",)


def swiglu_halves(y: jax.Array, dtype) -> jax.Array:
    """[..., 2N'] (gate | up) -> silu(gate) * up [..., N'] in dtype, computed in float32."""
    gate, up = jnp.split(y.astype(jnp.float32), 2, axis=-1)
    return (jax.nn.silu(gate) * up).astype(dtype)


def product_features(x, prologue: str | None) -> int:
    """The K the product takes from x [..., K] (or [..., 2K] with the SwiGLU prologue)."""
    if prologue not in (None, *PROLOGUES):
        raise ValueError(f"linear: prologue {prologue!r} is not one of {PROLOGUES}")
    return x.shape[-1] // 2 if prologue == "swiglu" else x.shape[-1]


class LinearCall(NamedTuple):
    """What the implementations' `supports` predicates read (shapes and dtypes only):
    the product's input as its 2-D view [M, K] (after any prologue), and the weight (a
    float [N, K] array or a `QuantizedWeight`; a call may be described with
    `jax.ShapeDtypeStruct`s in place of arrays)."""
    x: jax.ShapeDtypeStruct
    weight: Weight

    @classmethod
    def describe(cls, x, weight: Weight, prologue: str | None = None) -> LinearCall:
        """The call linear(x [..., K] (or [..., 2K]), weight, prologue=...) makes."""
        rows = math.prod(x.shape[:-1])
        k = product_features(x, prologue)
        return cls(jax.ShapeDtypeStruct((rows, k), x.dtype), weight)

    @property
    def rows(self) -> int:
        return self.x.shape[0]

    @property
    def quantized(self) -> bool:
        return isinstance(self.weight, QuantizedWeight)


def check_features(x, weight: Weight, prologue: str | None = None):
    """Raises ValueError unless x [..., K] (with the SwiGLU prologue [..., 2K]) and the
    weight [N, K] agree on K."""
    k = weight.shape[-1]
    if product_features(x, prologue) != k or (prologue and x.shape[-1] % 2):
        halves = " (the SwiGLU's two halves)" if prologue else ""
        raise ValueError(f"linear: x has {x.shape[-1]} features{halves}, the weight {k}")


def linear_epilogue(y: jax.Array, dtype, bias: jax.Array | None,
                    row_scale: jax.Array | None) -> jax.Array:
    """The product y [..., N] (float32, or already in dtype) -> y * row_scale + bias in
    dtype, computed in float32 (see the module docstring for where y is rounded)."""
    if bias is None and row_scale is None:
        return y.astype(dtype)
    y = y.astype(jnp.float32)
    if row_scale is not None:
        y = y * row_scale
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(dtype)


def float_product(x: jax.Array, weight: jax.Array, rounded: bool) -> jax.Array:
    """x [..., K] @ weight [N, K]^T as one XLA dot of x.dtype operands -> [..., N] in
    float32, or in x.dtype when `rounded` (a row scale follows: see the module docstring)."""
    return jax.lax.dot_general(
        x, weight.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())),
        preferred_element_type=x.dtype if rounded else jnp.float32)


def one_row_product(x: jax.Array, weight: jax.Array) -> jax.Array:
    """x [..., K] (one row in all) @ weight [N, K]^T -> [..., N] float32, as a multiply and
    a row reduction over K of the dot's operands (x.dtype values, exactly), which XLA runs
    with its reduction emitter in one pass over W (any number of rows gives the right
    result, but each row reads W once more)."""
    w = weight.astype(x.dtype).astype(jnp.float32)  # the dot's operands, exactly
    return jnp.sum(x.astype(jnp.float32)[..., None, :] * w, axis=-1)


def quantize_rows_fp8(x: jax.Array, absmax: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., K] float32 and its rows' largest |x| [..., 1] -> (e4m3 values [..., K], float32
    scales [..., 1]): scale = absmax / FP8_MAX (1 for a zero row), values x / scale rounded
    to nearest even. The arithmetic of every implementation of W8A8's activation
    quantization (`quantize_activations_fp8`, the GPU kernel's rows)."""
    scales = jnp.where(absmax > 0, absmax / FP8_MAX, 1.0)
    return jnp.clip(x / scales, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE), scales


def quantize_activations_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [M, K] -> (e4m3 [M, K], float32 per-token scales [M, 1]), x ~ values * scales."""
    x = x.astype(jnp.float32)
    return quantize_rows_fp8(x, jnp.max(jnp.abs(x), axis=-1, keepdims=True))


def dot_nt(x, w, dtype=jnp.float32):
    """x [M, K] . w [N, K]^T -> [M, N] in dtype."""
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=dtype)


def quantized_matmul_reference(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """The spec of a quantized product: x [M, K] @ W^T -> [M, N] in x.dtype (f32
    accumulation). W8A8 (`w.activations == "fp8"`) quantizes x per token to e4m3 and runs
    an fp8 dot; per-channel weights are a dot of the values cast to x.dtype (XLA fuses the
    cast into the dot); both products are rounded to x.dtype, then scaled. Others are
    dequantised to x.dtype first."""
    # The per-channel products come out of the dot in x.dtype and are scaled after: a
    # float32 product of a many-row step would be written and read back at twice the bytes
    # (at 256 decode rows, gate_up's float32 product is a quarter of its fp8 weight's
    # bytes), while the scaling fuses into whatever consumes y.
    if w.k_order is not None:  # values stored in the chunks' order: x's columns to match
        x, w = from_chunk_order(x), dataclasses.replace(w, k_order=None)
    if w.activations == "fp8":
        # x is made on its own before it is quantized: otherwise XLA fuses its producer
        # (the SwiGLU of the gate_up product, with that product's scales and the folded
        # norm) into both the per-token max and the quantization, and runs them as two
        # recomputing passes at a third of the copy rate (bench/NOTES.md, Linear and
        # quantized matmul: fp8 activations made before their quantization).
        xq, x_scales = quantize_activations_fp8(jax.lax.optimization_barrier(x))
        y = w8a8_product(xq, x_scales, w, x.dtype)
    elif w.group_size == w.shape[1] and w.offsets is None:
        y = dot_nt(x, w.values.astype(x.dtype), x.dtype).astype(jnp.float32) * w.scales[0]
    else:
        y = dot_nt(x, dequantize(w, x.dtype))
    return y.astype(x.dtype)


def w8a8_product(xq: jax.Array, x_scales: jax.Array, w: QuantizedWeight, dtype) -> jax.Array:
    """xq [M, K] e4m3 and its per-token scales [M, 1] (x quantized by
    `quantize_activations_fp8`, or a kernel of the same numbers) @ W^T for W8A8 weights,
    float32 [M, N]. Per-channel weight scales: an fp8 dot into `dtype` (x's), then both
    scales. Group-wise (DeepSeek's blocks): the e4m3 values (exact in `dtype`) against the
    weight dequantised to `dtype`, then the token scales; a kernel keeps that product in fp8
    (`mosaic/fp8_blocks_matmul.py`)."""
    if w.group_size == w.shape[1]:
        return dot_nt(xq, w.values, dtype).astype(jnp.float32) * x_scales * w.scales[0]
    return dot_nt(xq.astype(dtype), dequantize(w, dtype)) * x_scales


def quantized_product(matmul, x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x [..., K] @ W^T -> [..., N] in x.dtype by matmul(x [M, K], w) -> [M, N], a quantized
    product of 2-D operands (the reference, or a kernel)."""
    n, k = w.shape
    return matmul(x.reshape(-1, k), w).reshape(*x.shape[:-1], n)


def linear_reference(x: jax.Array, weight: Weight, bias: jax.Array | None = None,
                     row_scale: jax.Array | None = None, *, rounded: bool = False
                     ) -> jax.Array:
    """The spec (see the module docstring): one XLA dot for a float weight, dequantise +
    dot (`quantized_matmul_reference`) for a quantized one, then the epilogue."""
    if isinstance(weight, QuantizedWeight):
        y = quantized_product(quantized_matmul_reference, x, weight)
    else:
        y = float_product(x, weight, rounded=rounded or row_scale is not None)
    return linear_epilogue(y, x.dtype, bias, row_scale)
