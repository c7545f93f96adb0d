"""Grouped matmul over experts (MoE): Pallas kernel, TPU lowering (interpret mode elsewhere).

Same contract as `jaxinfer.ops.grouped_matmul.grouped_matmul_reference` (the spec):
  x            [M, K]     bfloat16 / float16 / float32 rows sorted by expert
  w            [E, N, K]  float expert weights (K-major), or a stacked QuantizedWeight:
                 values   [E, N, K]          int8, int4, float8_e4m3fn or float4_e2m1fn
                 scales   [E, K // g, N]     float32 (per channel: one row, g = K)
                 offsets  None or like scales
  group_sizes  [E]        int32, summing to at most M; expert e owns rows
                          [start_e, end_e), end_e = group_sizes[0] + ... + group_sizes[e]
  -> y         [M, N]     in x.dtype, float32 accumulation; rows >= sum(group_sizes) are 0.

Work list (megablox style, built by the wrapper in XLA from group_sizes, O(E + M / bm)):
  M is padded with zero rows to Mp = tiles_m * bm. A *visit* is one (expert, m-tile) pair
  whose rows intersect: expert e visits the tiles from start_e // bm to (end_e - 1) // bm
  (none when it is empty), so a tile holding the boundary between two experts is visited
  once by each. Visits are ordered by expert, hence by tile: the visits of one m-tile are
  consecutive, which lets its output block stay resident in VMEM between them. After the
  experts' visits come the *tail* visits, one per m-tile that holds no expert's row (all
  rows past sum(group_sizes)): they only write zeros. Their count, num_visits, is dynamic
  and is the grid's (dynamic) visit bound; the arrays are sized by its static bound
  W = tiles_m + E - 1 (each expert boundary inside a tile adds at most one visit), and the
  entries past num_visits (*spare* visits, never run on TPU) do nothing.
  Scalar-prefetched (SMEM), per visit v:
    out_tile [W]   the m-tile v writes (spares repeat the last tile)
    in_tile  [W]   the m-tile of x v reads (dead visits repeat the last live one)
    expert   [W]   the expert whose weights v reads (dead visits: the last live one)
    rows     [2W]  [start_e, end_e) of v's expert, flat; (0, 0) for dead visits
  Dead (tail and spare) visits also pin the K block index to the last one, so their
  block indices equal the previous step's and the pipeline issues no DMA for them.

Grid = (N / bn, num_visits, K / bk), K innermost ("arbitrary": the [bm, bn] float32 VMEM
accumulator sums over it); visits "arbitrary" (consecutive visits share an output
block); N blocks "parallel" (megacore split). Step (j, v, kk) reads x block
[bm, bk] at (in_tile[v], kk) and the weight block [bn, bk] of expert
expert[v] at (j, kk), and contracts the last axis of both (dot_general
((1,), (1,)): the [E, N, K] weights are never transposed). At the last K step the
rows of the tile in [start_e, end_e) are stored; the other rows keep what earlier
visits of the tile stored, or get 0 on the tile's first visit. So every output row is
written, and a row no expert owns is 0 (partial tiles and tail tiles alike).

Quantized weights (as `pallas_kernels/quantized_matmul.py`): the values block is read
as stored (int4 / fp4 two per byte, int8 / fp8 one) and cast to the dot dtype in VMEM
(exact: |int| <= 128, e4m3 and e2m1 fit bf16 and f16). Scales are applied to float32
partial products, never to the weights: per group (g < K) the block's K range is cut
into bk / g slices, partial = x_t . v_t^T scaled by that group's [1, bn] scale row,
plus sum_k x_t [bm, 1] times the offset row; per channel without offsets the scale
multiplies the accumulator once at the last K step. This adds no rounding beyond the
f32 accumulation and needs no transpose of the [K / g, N] scales (N stays on lanes on
both sides). Scales / offsets are viewed as [E, K / bk, bk / g, N] so one K block's rows
form a whole block (bk / g may be < 8, which a [bk / g, bn] block of a 2-D view would
not allow). MXFP4 (float4_e2m1fn, g = 32, power-of-two scales) is the g = 32 case.
W8A8 (`activations == "fp8"`, per-channel fp8 weights, no offsets): the wrapper
quantizes x per token to e4m3 (`quantize_activations_fp8`), the kernel feeds both fp8
operands to the dot and multiplies by x_scale [bm, 1] and w_scale [1, bn] at the end.

Float weights are read as stored and cast to x.dtype in VMEM (as the reference casts
them). float32 x: dots at Precision.HIGHEST (the MXU's default takes bf16 passes).

This file has only been run in TPU interpret mode (`pltpu.InterpretParams()`) on CPU,
and lowered to Mosaic by `jax.export` for TPU (tests/test_grouped_matmul_tpu.py); Mosaic's
own compile and a real TPU are untested. Likely snags there: lane slices narrower than
128 for g = 32 / 64, float4_e2m1fn refs and casts, fp8 dots on TPUs without an fp8 MXU,
float16 dots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxinfer.ops.linear import quantize_activations_fp8
from jaxinfer.ops.platform import tpu_interpret_params
from jaxinfer.ops.quant import FP8_DTYPE, QuantizedWeight, stored_order_reason
from jaxinfer.pallas_kernels.tpu_blocks import (  # the dense kernel's N / K blocking rules
    blocks_reason,
    default_block_k,
    default_block_n,
    dequant_dot,
    round_up,
    running_on_tpu,
    sublanes,
)

ACTIVATION_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
# Block defaults. On TPU, bm is capped by the weights' bits per element (TPU_BLOCK_M):
# every visit streams one expert's [N, K] weights and runs the MXU over all bm rows,
# however few of them are the expert's, so a visit costs max(N K b / HBM rate,
# 2 bm N K / MXU rate) for b bytes per weight. bm = b * MXU rate / (2 HBM rate)
# (~120 b on v5e, ~280 b on v6e) balances the two: a decode step (few rows per expert)
# stays on the bytes floor, a prefill (full tiles) on the MXU floor with the fewest
# weight re-reads. bn, bk: MXU-sized, and large enough that one step's weight DMA
# amortizes the per-step overhead. In interpret mode (CPU tests): small blocks, so the
# test shapes cross tile, N and K boundaries and steps stay cheap.
TPU_BLOCK_M = {4: 64, 8: 128, 16: 256, 32: 256}  # weight bits -> bm cap
INTERPRET_BLOCK_M = 64  # N / K blocks: pallas_kernels/tpu_blocks.py


def _row_dtype(x: jax.Array, w) -> jnp.dtype:
    """The narrowest dtype an [bm, ...] block is read in: fp8 x under W8A8, else x's."""
    return FP8_DTYPE if _w8a8(w) else x.dtype


def _w8a8(w) -> bool:
    return isinstance(w, QuantizedWeight) and w.activations == "fp8"


def _group(w) -> int:
    return w.group_size if isinstance(w, QuantizedWeight) else w.shape[-1]


def _weight_bits(w) -> int:
    """Bits per stored weight element (4 for int4 / fp4, whose itemsize reads 1)."""
    dtype = (w.values if isinstance(w, QuantizedWeight) else w).dtype
    info = jnp.iinfo if jnp.issubdtype(dtype, jnp.integer) else jnp.finfo
    return info(dtype).bits


def _block_m(m: int, dtype, block_m: int | None, weight_bits: int, on_tpu: bool) -> int:
    """block_m if given, else the fewest tiles of <= the default, split evenly (rounded
    to the sublane tile), which bounds the zero-row padding by one sublane tile per tile."""
    tile = sublanes(dtype)
    if block_m:
        return min(block_m, round_up(m, tile))
    cap = max(TPU_BLOCK_M.get(weight_bits, 256), tile) if on_tpu else INTERPRET_BLOCK_M
    return round_up(-(-m // -(-m // cap)), tile)


def _reason(x: jax.Array, w, bm: int | None, bn: int | None, bk: int | None) -> str | None:
    if (reason := stored_order_reason(w)) is not None:
        return reason
    if x.ndim != 2:
        return f"x must be 2-D [M, K], got shape {tuple(x.shape)}"
    if jnp.dtype(x.dtype) not in map(jnp.dtype, ACTIVATION_DTYPES):
        return f"x dtype {jnp.dtype(x.dtype).name}: the kernel takes bfloat16 / float16 / float32"
    if len(w.shape) != 3:
        return f"weights {tuple(w.shape)} must be a 3-D [E, N, K] stack"
    _, n, k = w.shape
    if x.shape[1] != k:
        return f"x has {x.shape[1]} features, the weights {k}"
    g = _group(w)
    if isinstance(w, QuantizedWeight):
        if w.activations not in (None, "fp8"):
            return f"activation mode {w.activations!r} (expected None or 'fp8')"
        if _w8a8(w) and (w.kind != "fp8" or g != k or w.offsets is not None):
            return "W8A8 needs fp8 weights with per-channel scales and no offsets"
    elif not jnp.issubdtype(w.dtype, jnp.floating):
        return f"float weights must have a floating dtype, got {jnp.dtype(w.dtype).name}"
    if bm is not None and bm % sublanes(_row_dtype(x, w)):
        return f"block_m={bm} is not a multiple of the sublane tile"
    return blocks_reason(n, k, g, bn, bk)


def unsupported_reason(x: jax.Array, w) -> str | None:
    """Why the kernel (at its default blocks) cannot take these inputs, or None."""
    on_tpu = running_on_tpu()
    if len(w.shape) != 3:
        return _reason(x, w, None, None, None)
    _, n, k = w.shape
    return _reason(x, w, None, default_block_n(n, on_tpu),
                   default_block_k(k, _group(w), on_tpu))


def work_list(group_sizes: jax.Array, tiles_m: int, bm: int):
    """The work list of the module docstring: ((out_tile, in_tile, expert, rows), num_visits):
    [W] int32 arrays (rows [2W]), W = tiles_m + E - 1, and the int32 count of visits that
    do something (the experts' visits, then the tail visits)."""
    e = group_sizes.shape[0]
    bound = tiles_m + e - 1
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    total = ends[-1]
    first_tile = starts // bm
    tiles_of = jnp.where(sizes > 0, (ends + bm - 1) // bm - first_tile, 0)
    visits_end = jnp.cumsum(tiles_of)  # exclusive end of each expert's visits
    expert_visits = visits_end[-1]
    covered = (total + bm - 1) // bm  # tiles holding a row of some expert

    v = jnp.arange(bound, dtype=jnp.int32)
    live = v < expert_visits
    expert = jnp.minimum(jnp.searchsorted(visits_end, v, side="right"), e - 1).astype(jnp.int32)
    own_tile = first_tile[expert] + v - (visits_end[expert] - tiles_of[expert])
    # Tail visits take the uncovered tiles in order; spares repeat the last tile.
    out_tile = jnp.where(live, own_tile, covered + v - expert_visits)
    # The clamp also keeps a sum(group_sizes) > M (outside the contract) from reading
    # out of bounds.
    out_tile = jnp.minimum(out_tile, tiles_m - 1)
    last_expert = jnp.max(jnp.where(sizes > 0, jnp.arange(e, dtype=jnp.int32), 0))
    in_tile = jnp.where(live, out_tile, jnp.maximum(jnp.minimum(covered, tiles_m) - 1, 0))
    expert = jnp.where(live, expert, last_expert)
    rows = jnp.stack([jnp.where(live, starts[expert], 0),
                      jnp.where(live, ends[expert], 0)], axis=1).reshape(-1)
    num_visits = expert_visits + jnp.maximum(tiles_m - covered, 0)
    return (out_tile, in_tile, expert, rows), num_visits


def _dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [R, K] . b [N, K]^T -> [R, N] float32 (float32 operands at full precision)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _kernel(out_tile_ref, in_tile_ref, expert_ref, rows_ref, *refs, quantized: bool,
            group: int, per_channel: bool, has_offsets: bool, w8a8: bool):
    """One (n block, visit, K block) step; see the module docstring."""
    del in_tile_ref, expert_ref  # used by the index maps only
    x_ref, w_ref, *refs = refs  # [bm, bk], [bn, bk]
    s_ref = refs.pop(0) if quantized else None  # [bk / g or 1, bn] float32
    o_ref = refs.pop(0) if has_offsets else None  # like s_ref
    xs_ref = refs.pop(0) if w8a8 else None  # [bm, 1] float32 per-token scales
    out_ref, acc_ref = refs  # [bm, bn] x.dtype, [bm, bn] float32 scratch
    bm = out_ref.shape[0]
    v = pl.program_id(1)
    kk = pl.program_id(2)
    last_k = kk == pl.num_programs(2) - 1
    row_start = rows_ref[2 * v]
    row_end = rows_ref[2 * v + 1]
    live = row_end > row_start
    tile = out_tile_ref[v]
    first_visit = (v == 0) | (tile != out_tile_ref[jnp.maximum(v - 1, 0)])
    # Per channel, the scale is applied once at the end unless offsets force per-step units.
    scale_per_step = quantized and (not per_channel or has_offsets)

    @pl.when(live & (kk == 0))
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)  # scratch starts as garbage (NaN in interpret)

    @pl.when(live)
    def _():
        acc_ref[...] += dequant_dot(
            x_ref[...], w_ref[...], s_ref, o_ref,
            width=x_ref.shape[1] if (per_channel or not quantized) else group,
            scale_per_step=scale_per_step, w8a8=w8a8, dot=_dot_nt)

    @pl.when(last_k & live)
    def _():
        y = acc_ref[...]
        if quantized and not scale_per_step:
            y = y * s_ref[0:1, :]
        if w8a8:
            y = y * xs_ref[...]
        row = tile * bm + lax.broadcasted_iota(jnp.int32, y.shape, 0)
        mine = (row >= row_start) & (row < row_end)

        # On the tile's first visit the output buffer holds garbage (an earlier tile's
        # block, or NaN in interpret mode): the other rows get 0, and the visits of
        # their own experts, which come next, overwrite theirs.
        @pl.when(first_visit)
        def _():
            out_ref[...] = jnp.where(mine, y, 0.0).astype(out_ref.dtype)

        # Later visits keep what the earlier visits of the tile stored (selected in
        # float32: older TPUs have no bf16 VPU).
        @pl.when(jnp.logical_not(first_visit))
        def _():
            kept = out_ref[...].astype(jnp.float32)
            out_ref[...] = jnp.where(mine, y, kept).astype(out_ref.dtype)

    @pl.when(last_k & first_visit & jnp.logical_not(live))
    def _():
        out_ref[...] = jnp.zeros_like(out_ref)  # a tail tile: no expert owns its rows


# Jitted so that call sites with the same shapes (a model's layers) share one lowering.
@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "interpret"))
def grouped_matmul_tpu(x: jax.Array, w, group_sizes: jax.Array, *, block_m: int | None = None,
                       block_n: int | None = None, block_k: int | None = None,
                       interpret=None) -> jax.Array:
    """x [M, K], w [E, N, K] (float or QuantizedWeight), group_sizes [E] -> [M, N] in x.dtype.

    Blocks default to MXU-sized ones on TPU and to small ones in interpret mode
    (TPU_BLOCK_M; N / K blocks: pallas_kernels/tpu_blocks.py); block_m is
    capped at M rounded up to the sublane tile. `interpret`: None runs Mosaic on TPU and
    the TPU interpreter elsewhere; anything else is passed to `pl.pallas_call`. Raises
    ValueError for inputs the kernel cannot take (`unsupported_reason`).
    """
    on_tpu = running_on_tpu()
    if len(w.shape) == 3:
        _, n, k = w.shape
        bn = block_n or default_block_n(n, on_tpu)
        bk = block_k or default_block_k(k, _group(w), on_tpu)
    else:
        bn = bk = None
    reason = _reason(x, w, block_m, bn, bk)
    if reason is not None:
        raise ValueError(f"grouped_matmul_tpu: {reason}")
    if interpret is None:
        interpret = tpu_interpret_params()
    m = x.shape[0]
    e = w.shape[0]
    if m == 0:
        return jnp.zeros((0, n), x.dtype)
    quantized = isinstance(w, QuantizedWeight)
    w8a8 = _w8a8(w)
    g = _group(w)
    per_channel = g == k
    bm = _block_m(m, _row_dtype(x, w), block_m, _weight_bits(w), on_tpu)
    tiles_m = -(-m // bm)
    mp = tiles_m * bm
    tiles_k = k // bk
    x_in = jnp.pad(x, ((0, mp - m), (0, 0)))  # zero rows: finite, never stored
    metadata, num_visits = work_list(group_sizes, tiles_m, bm)

    def k_block(v, kk, rows):
        # Dead visits stay on the last K block, so their blocks need no new DMA.
        return jnp.where(rows[2 * v + 1] > rows[2 * v], kk, tiles_k - 1)

    def x_map(j, v, kk, out_tile, in_tile, expert, rows):
        return in_tile[v], k_block(v, kk, rows)

    def w_map(j, v, kk, out_tile, in_tile, expert, rows):
        return expert[v], j, k_block(v, kk, rows)

    def out_map(j, v, kk, out_tile, in_tile, expert, rows):
        return out_tile[v], j

    values = w.values if quantized else w
    operands = [x_in, values]
    in_specs = [pl.BlockSpec((bm, bk), x_map), pl.BlockSpec((None, bn, bk), w_map)]
    if quantized:
        # Each K block's scale / offset rows as one whole [bk / g, N] slab (per channel:
        # the single row, reused by every K block).
        rows_per_block = 1 if per_channel else bk // g

        def group_map(j, v, kk, out_tile, in_tile, expert, rows):
            return expert[v], (0 if per_channel else k_block(v, kk, rows)), 0, j

        group_spec = pl.BlockSpec((None, None, rows_per_block, bn), group_map)
        operands.append(w.scales.reshape(e, -1, rows_per_block, n))
        in_specs.append(group_spec)
        if w.offsets is not None:
            operands.append(w.offsets.reshape(e, -1, rows_per_block, n))
            in_specs.append(group_spec)
    if w8a8:
        x_in, x_scales = quantize_activations_fp8(x_in)
        operands[0] = x_in
        operands.append(x_scales)
        in_specs.append(pl.BlockSpec((bm, 1), lambda j, v, kk, o, i, ex, r: (i[v], 0)))

    kernel = functools.partial(_kernel, quantized=quantized, group=g, per_channel=per_channel,
                               has_offsets=quantized and w.offsets is not None, w8a8=w8a8)
    weight_bytes = w.nbytes if quantized else values.size * values.dtype.itemsize
    cost = pl.CostEstimate(
        flops=2 * m * n * k, transcendentals=0,
        # Upper bound: one expert's weights per visit, x once per N block.
        bytes_accessed=int(weight_bytes / e * (tiles_m + e - 1)
                           + x_in.size * x_in.dtype.itemsize * (n // bn)
                           + mp * n * jnp.dtype(x.dtype).itemsize))
    y = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            # A dynamic bound: only visits that do something are run.
            grid=(n // bn, num_visits, tiles_k),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((bm, bn), out_map),
            scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((mp, n), x.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
        cost_estimate=cost,
        name="grouped_matmul",
    )(*metadata, *operands)
    return y[:m]
