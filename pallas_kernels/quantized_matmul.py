"""Weight-quantized matmul: Pallas kernel, TPU lowering (interpret mode elsewhere).

Same contract as `jaxinfer.ops.linear.quantized_matmul_reference` (the
spec; weight layouts in `jaxinfer.ops.quant`):
  x  [M, K]  bfloat16 / float16 activations, any M >= 1
  w  QuantizedWeight of W [N, K]:
       values   [N, K]          int8, int4 or float8_e4m3fn, K-major (as stored)
       scales   [K // g, N]     float32, g = w.group_size (per channel: one row, g = K)
       offsets  None or [K // g, N] float32:  W = values * scale + offset
  -> y = x @ W^T  [M, N] in x.dtype, accumulated in float32.

Grid and blocking:
  grid = (Mp / bm, N / bn, K / bk), K innermost ("arbitrary": the [bm, bn] float32
  VMEM scratch accumulates over it; M and N blocks are "parallel"). Step (i, j, k)
  reads x[i*bm:, k*bk:] [bm, bk], the weight block values[j*bn:, k*bk:] [bn, bk]
  (stored bytes: int8 / fp8 / packed int4) and that K block's scale / offset rows
  [bk / g, bn]. M is split evenly into blocks of at most the default bm, rounded
  to the sublane tile, and the wrapper pads it with zero rows (sliced off after);
  N and K must be multiples of bn and bk, which are multiples of 128 (or K whole
  when K <= the largest default bk; see `unsupported_reason`). Scales and
  offsets are viewed as [K / bk, bk / g, N] (a free reshape) so that each K block's
  rows are one whole block: a [bk / g, bn] block of the 2-D array would break the
  8-row sublane tiling rule whenever bk / g < 8.

Scales and offsets:
  Grouped (g < K): bk is a multiple of g, and the step loops statically over the
  bk / g sub-slices of its block: partial = x_t . v_t^T (f32), scaled by that
  group's [1, bn] scale row, plus (x_t summed over the group) [bm, 1] times the
  [1, bn] offset row, since sum_k x[m,k] * (v[n,k] * s + o) = s * (x . v) + o * sum_k x.
  Offsets are therefore applied inside the kernel, per group, not by XLA.
  Per channel (g = K): one dot per step, and the scale row multiplies the
  accumulator once at the last K step; with offsets, the scale and the
  offset term are applied per step instead (the accumulator must stay in one unit).

Weight values:
  Weight-only formats: the block is loaded as stored (int4 still two per byte in
  HBM and VMEM: half the bytes of int8) and cast to x.dtype in VMEM right before
  the dot. The cast is exact (|int| <= 128 and e4m3 both fit the 8-bit bf16
  significand and f16), and the scale is applied to the f32 partial product, never
  to the weight, so no rounding beyond the f32 accumulation is added. The MXU
  has no bf16 x int8 mode, hence the cast rather than a mixed-type dot.
  W8A8 (`w.activations == "fp8"`, per-channel fp8 weights only): the wrapper
  quantizes x per token to e4m3 with `quantize_activations_fp8` (XLA, one pass over
  x) and the kernel feeds both fp8 operands straight into the dot; the last K step
  multiplies by x_scale[m] (a [bm, 1] block) and w_scale[n].

int4 refs work in the TPU interpreter as they are (no int4 -> int8 repacking in
the wrapper). This file has only been run in TPU interpret mode
(`pltpu.InterpretParams()`) on CPU; it is untested on a real TPU. Likely
Mosaic snags there: unaligned lane slices for g = 32 / 64 (sub-slices narrower
than the 128-lane vreg), fp8 dots on TPUs without an fp8 MXU, int4 -> bf16 casts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxinfer.ops.linear import quantize_activations_fp8
from jaxinfer.ops.platform import tpu_interpret_params
from jaxinfer.ops.quant import FP8_DTYPE, QuantizedWeight, stored_order_reason
from jaxinfer.pallas_kernels.tpu_blocks import (
    INTERPRET_BLOCKS,
    TPU_BLOCKS,
    blocks_reason,
    default_block_k,
    default_block_n,
    dequant_dot,
    round_up,
    running_on_tpu,
    sublanes,
)

ACTIVATION_DTYPES = (jnp.bfloat16, jnp.float16)


def _block_m(m: int, dtype, block_m: int | None, on_tpu: bool) -> int:
    """block_m if given, else the fewest blocks of <= the default, split evenly.

    Even splitting bounds the zero-row padding by one sublane tile per block
    (M = 300: 2 x 160 rows rather than 2 x 256).
    """
    tile = sublanes(dtype)
    if block_m:
        return min(block_m, round_up(m, tile))
    cap = (TPU_BLOCKS if on_tpu else INTERPRET_BLOCKS)["m"]
    return round_up(-(-m // -(-m // cap)), tile)


def _reason(x: jax.Array, w: QuantizedWeight, bm: int | None, bn: int | None,
            bk: int | None) -> str | None:
    if (reason := stored_order_reason(w)) is not None:
        return reason
    if x.ndim != 2:
        return f"x must be 2-D [M, K], got shape {x.shape}"
    if jnp.dtype(x.dtype) not in map(jnp.dtype, ACTIVATION_DTYPES):
        return f"x dtype {jnp.dtype(x.dtype).name}: the kernel takes bfloat16 / float16"
    n, k = w.shape
    if x.shape[1] != k:
        return f"x has {x.shape[1]} features, the weight {k}"
    g = w.group_size
    if w.activations not in (None, "fp8"):
        return f"activation mode {w.activations!r} (expected None or 'fp8')"
    if w.activations == "fp8" and (w.kind != "fp8" or g != k or w.offsets is not None):
        return "W8A8 needs fp8 weights with per-channel scales and no offsets"
    if bm is not None and bm % sublanes(FP8_DTYPE if w.activations else x.dtype):
        return f"block_m={bm} is not a multiple of the sublane tile"
    return blocks_reason(n, k, g, bn, bk)


def unsupported_reason(x: jax.Array, w: QuantizedWeight) -> str | None:
    """Why the kernel (at its default blocks) cannot take these inputs, or None."""
    on_tpu = running_on_tpu()
    n, k = w.shape
    return _reason(x, w, None, default_block_n(n, on_tpu),
                   default_block_k(k, w.group_size, on_tpu))


def _kernel(*refs, group: int, per_channel: bool, has_offsets: bool, w8a8: bool):
    """One (i, j, k) step; see the module docstring."""
    x_ref, w_ref, s_ref, *refs = refs  # [bm, bk], [bn, bk], [bk / g or 1, bn]
    o_ref = refs.pop(0) if has_offsets else None  # like s_ref
    xs_ref = refs.pop(0) if w8a8 else None  # [bm, 1] float32 per-token scales
    out_ref, acc_ref = refs  # [bm, bn] x.dtype, [bm, bn] float32 scratch
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)  # scratch starts as garbage (NaN in interpret)

    # Per channel, the scale is applied once at the end unless offsets force per-step units.
    scale_per_step = not per_channel or has_offsets
    acc_ref[...] += dequant_dot(x_ref[...], w_ref[...], s_ref, o_ref,
                                width=x_ref.shape[1] if per_channel else group,
                                scale_per_step=scale_per_step, w8a8=w8a8)

    @pl.when(k == pl.num_programs(2) - 1)
    def _():
        y = acc_ref[...]
        if not scale_per_step:
            y = y * s_ref[0:1, :]
        if w8a8:
            y = y * xs_ref[...]
        out_ref[...] = y.astype(out_ref.dtype)


def quantized_matmul_tpu(x: jax.Array, w: QuantizedWeight, *, block_m: int | None = None,
                         block_n: int | None = None, block_k: int | None = None,
                         interpret=None) -> jax.Array:
    """x [M, K] @ W^T -> [M, N] in x.dtype (see the module docstring).

    Blocks default to MXU-sized ones on TPU and to small ones in interpret mode
    (`tpu_blocks.TPU_BLOCKS` / `INTERPRET_BLOCKS`); block_m is capped at M rounded up to the
    sublane tile. `interpret`: None runs Mosaic on TPU and the TPU interpreter
    elsewhere; anything else is passed to `pl.pallas_call`. Raises ValueError for
    inputs the kernel cannot take (`unsupported_reason`).
    """
    on_tpu = running_on_tpu()
    n, k = w.shape
    g = w.group_size
    bn = block_n or default_block_n(n, on_tpu)
    bk = block_k or default_block_k(k, g, on_tpu)
    reason = _reason(x, w, block_m, bn, bk)
    if reason is not None:
        raise ValueError(f"quantized_matmul_tpu: {reason}")
    if interpret is None:
        interpret = tpu_interpret_params()
    m = x.shape[0]
    w8a8 = w.activations == "fp8"
    per_channel = g == k
    bm = _block_m(m, FP8_DTYPE if w8a8 else x.dtype, block_m, on_tpu)
    mp = round_up(m, bm)
    x_in = jnp.pad(x, ((0, mp - m), (0, 0)))  # zero rows: finite, sliced off below

    # Each K block's scale / offset rows as one whole [bk / g, N] slab (per channel:
    # the single row, reused by every K block).
    rows = 1 if per_channel else bk // g
    groups = w.scales.reshape(-1, rows, n)
    if per_channel:
        group_spec = pl.BlockSpec((None, rows, bn), lambda i, j, kk: (0, 0, j))
    else:
        group_spec = pl.BlockSpec((None, rows, bn), lambda i, j, kk: (kk, 0, j))
    operands = [w.values, groups]
    in_specs = [pl.BlockSpec((bn, bk), lambda i, j, kk: (j, kk)), group_spec]
    if w.offsets is not None:
        operands.append(w.offsets.reshape(-1, rows, n))
        in_specs.append(group_spec)
    if w8a8:
        x_in, x_scales = quantize_activations_fp8(x_in)
        operands.append(x_scales)
        in_specs.append(pl.BlockSpec((bm, 1), lambda i, j, kk: (i, 0)))

    kernel = functools.partial(_kernel, group=g, per_channel=per_channel,
                               has_offsets=w.offsets is not None, w8a8=w8a8)
    y = pl.pallas_call(
        kernel,
        grid=(mp // bm, n // bn, k // bk),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)), *in_specs],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, n), x.dtype),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="quantized_matmul",
    )(x_in, *operands)
    return y[:m]
