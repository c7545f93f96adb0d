"""Grouped matmul over MoE experts for Hopper, as a Mosaic GPU kernel (`plgpu.kernel`).

Same contract as `jaxinfer.ops.grouped_matmul.grouped_matmul_reference` (the spec):
x [M, K] bf16/f16 rows sorted by expert, W [E, N, K] (K-major, same dtype as x),
group_sizes [E] int32 (dynamic, summing to at most M) -> y [M, N] in x.dtype,
accumulated in float32; rows at or past sum(group_sizes) come out as zeros.

Algorithm (the transposed product y_e^T = W_e x_e^T, so the weight is wgmma's A):
- Work items, built by XLA from group_sizes on the device (a prefix sum over E + 1
  groups, the last one being the zero tail): one item per (group, window of
  `max_rows` rows, block of `block_n` = 64 * `Config.owners` weight rows). A group's
  windows start at its first row rounded down to a multiple of 8 (the TMA of an
  8-row-tiled shared buffer addresses x in whole tiles: an unaligned start reads the
  wrong rows on the GPU, though interpret mode slices exactly). An expert with no rows
  has no item, so it costs no weight reads; an expert whose rows fit one window has one
  item per N block, so its weight is streamed once. The table has a static length (about
  M / max_rows + min(E, M) + 2 windows, times the N blocks); a scalar counts its live
  prefix. Decode steps (M <= E, M <= 128) use a cheaper per-row table instead
  (`row_items`): max_rows >= M, so each group is one window. It holds each row's
  (group, group start, group end) (`RowGroups`: built from group_sizes, or passed in
  by the MoE layer, which knows them from its sort); item i is (row, N block) =
  divmod(i, n_blocks), rows that start no group skip theirs, and the kernel derives
  the window and B width from the group's span.
- Persistent grid of one CTA per SM; CTA c takes items c, c + grid, ... Each CTA has
  one producer warpgroup and `compute_wgs` consumer warpgroups sharing a
  `num_stages`-deep ring of shared-memory slots that runs on across items (the next
  item's loads overlap this item's last MMAs and its store).
- Operands swap: a consumer's weight rows (64, wgmma M) are the A operand, straight
  from shared memory; the item's token rows are B (wgmma N). The B width is chosen
  per item among the powers of two 8..max_rows (one code path each, picked at run
  time): the narrowest that holds the window up to the item's last row, so a decode
  expert with 3 rows mostly loads 8 token rows and runs an N=8 MMA, and a full window
  of a prefill runs N=max_rows. A group's short last window (up to `last_extra` rows)
  joins the window before it, which then runs N=max_rows + last_extra: a few rows do
  not stream the expert's weight block once more. A window that would run past x
  slides back (x is padded only to a multiple of 8 rows, or to the widest B width when
  M is smaller).
- Per K step of `piece` * k_pieces columns (pieces of 64 columns; 128 for quantized
  weights, `piece_cols`) the producer issues, per piece, one TMA per 64-row part of the
  N block for its 64 x piece weight box (swizzled; and one for its group scales), and one
  for the token rows. A consumer waits for the slot, issues its wgmmas, keeps one step of
  float MMAs in flight (quantized: none, see below) and hands the previous step's slot
  back.
- Epilogue: the float32 accumulator [64 features, width tokens] is cast and stored
  transposed into shared memory ([tokens, 64], row-major), then TMA-stored to
  y[row_start:row_start + rows, n0:n0 + 64]. TMA boxes have static shapes, so the
  `rows` (dynamic) are written as a ladder of power-of-two row boxes (the binary digits
  of `rows`): rows of other experts inside the tile are never written. Zero-tail items
  load nothing and store zeros the same way. That transposed store into an unswizzled
  buffer is bank-conflicted (2-byte stores 128 bytes apart): at 4096 tokens it was ~40% of
  Qwen3's down projection. With `groups_aligned` (every group size a multiple of 8, the
  MoE layer's prefill layout) every window starts and ends on an 8-row tile, so the
  buffer is 128-byte swizzled like the operands and the ladder stops at 8-row boxes.
- `swiglu` (W = [gate; up] rows, decode sizes): an item streams the same N block of
  the gate and the up rows into two accumulators and stores silu(gate) * up, so the
  activation needs no kernel of its own and [M, 2N'] never goes to memory.

Why one kernel for every regime: with B up to 256 token rows a CTA tile is
[128 features x 256 tokens] (two consumers, 64 x 256 accumulators each), the usual
Hopper GEMM tile, so prefill (thousands of rows per expert) runs the same code as
decode (a few rows per expert); `choose_config` picks max_rows from the expected rows
per expert, and shared-memory depth from what fits.

Quantized experts (`QuantizedWeight` stacks of int8, int4 or fp4 values, symmetric): the
weight boxes stream in their stored width (half or a quarter of bf16's bytes, the point at
decode sizes) and become wgmma's A operand from registers, as in the quantized matmul
(`jaxinfer.mosaic.quantized_matmul`): a consumer loads its box in the upcast register
layout, converts it to x's dtype, and for group-wise scales multiplies each row by its
piece's scale, which the producer brings into shared memory beside the box (a piece lies
in one group: pieces of 128 K columns, `QUANT_PIECE`, or 64 for groups of 64). Per-channel
scales multiply the float32 accumulator once, in the epilogue. Each step's MMAs are
waited for before the next step's upcasts (register operands left in flight gave wrong
sums). Where one consumer would own each N block (decode sizes), two consumers split the
step's pieces instead (`Config.split_k`): the second hands its partial sums to the first
through shared memory. fp4 (MXFP4, NVFP4) is read as 16-bit words and made bf16 with
integer ops (`jaxinfer.mosaic.nibble_words`); with `Config.words32` (the default for
4-bit experts in token tiles up to WORDS32_MAX_WIDTH), 4-bit codes are read as 32-bit
words and multiplied by mma.sync instead of wgmma.

On a machine without a GPU the same kernel runs in Mosaic GPU interpret mode (tests);
there the upcast box goes through shared memory (interpret mode has no register A
operand). Constraints (else `unsupported_reason`): float weights in x's dtype or
quantized ones; x bf16 or f16; N and K multiples of 64. Quantized experts the kernel does
not upcast itself (fp8, zero points, groups of 32: `upcasts_in_registers`) are
dequantised into a float stack by XLA first, which suits prefill sizes; at decode sizes
the registry reduces their rows by row instead (`jaxinfer.ops.grouped_matmul_registry`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jaxinfer.mosaic import nibble_words
from jaxinfer.ops.grouped_matmul import GROUP_ALIGN, RowGroups, in_group_order
from jaxinfer.ops.linear import swiglu_halves
from jaxinfer.ops.platform import gpu_sm_count, mosaic_interpret_params
from jaxinfer.ops.quant import QuantizedWeight, chunk_order, dequantize, stored_order_reason

ROWS = 64  # weight rows (output features) per consumer warpgroup: the wgmma M tile
PIECE = 64  # K columns per TMA box: 128 bytes of bf16, one 128-byte swizzle row
# Quantized weights: K columns per box where the scales allow (128 bytes of int8), so that
# each TMA and each upcast moves as much as a bf16 box (`piece_cols`).
QUANT_PIECE = 128
QUANT_STEP_BYTES = 16384  # quantized weight bytes a step at decode widths (`_quantized_step`)
MIN_WIDTH = 8  # the narrowest wgmma N
MAX_WIDTH = 256  # the widest wgmma N
NUM_SMS = 132  # H100 SXM (the persistent grid on a GPU that does not say)
INTERPRET_CTAS = 4  # persistent CTAs in interpret mode (each one is simulated)
SMEM_BYTES = 227 * 1024
# Up to this many rows (a decode step's tokens x top-k), and no more than the experts,
# max_rows >= M and the work items come from the per-row table (`row_items`).
MAX_ROW_ITEMS_M = 128
# The widest token tile (max_rows + last_extra) that reads 4-bit experts as 32-bit words
# under mma.sync by default (the widest timed faster; 256-row tiles are not timed).
WORDS32_MAX_WIDTH = 128
# The widest token tile that takes `Config.share_sm` by default, in steps with no more rows
# than experts (wider tiles, or halved rings, ran slower: bench/NOTES.md, Grouped matmul
# (Mosaic GPU): Two CTAs an SM).
SHARE_SM_MAX_WIDTH = 16


@dataclasses.dataclass(frozen=True)
class Config:
    max_rows: int = 16  # widest token tile (wgmma N): a power of two, 8..256
    # Consumer warpgroups, each owning 64 weight rows of the N block (or, with split_k,
    # both the same 64 rows and half of each step's pieces)
    compute_wgs: int = 2
    k_pieces: int = 1  # K pieces (of 64 columns, or 128 for quantized weights) a step
    num_stages: int = 4  # ring slots
    num_ctas: int | None = None  # persistent CTAs (None: the SM count; a few in interpret mode)
    # Rows a group's last window may take beyond max_rows, instead of a window of its own
    # (a multiple of 8; max_rows + last_extra <= 256): see `build_items`.
    last_extra: int = 0
    # The two consumers split each step's K pieces instead of the N block: both own the
    # same 64 weight rows, and the second hands its partial sums to the first through
    # shared memory (quantized decode: two consumers share the upcasts; 1-9% faster,
    # bench/NOTES.md, Grouped matmul (Mosaic GPU): Quantized: two consumers split K at decode).
    split_k: bool = False
    # 4-bit experts (int4, fp4; bf16 rows) read as 32-bit words in mma.sync's operand
    # layout and multiplied by warp-level mma.sync instead of wgmma, as the dense kernel's
    # `words32` (`nibble_words.words32_mma`): wgmma with a register operand costs ~90 SM
    # cycles a 64 x 16 box at decode widths (bench/NOTES.md, Linear and quantized matmul:
    # mma.sync in place of wgmma). The default for token tiles up to WORDS32_MAX_WIDTH:
    # 1.34-1.56x the 16-bit fp4 words under wgmma for gpt-oss's MXFP4 experts at 1 to 64
    # tokens, 1.16x at 256 (128-row tiles; H200).
    words32: bool = False
    # With words32: no register hand-over between warpgroups (`set_max_registers`), so that
    # two CTAs can share an SM (num_ctas twice the SMs, each in half the shared memory), as
    # the dense kernel's `share_sm` (1.14x for its fused int4 gate_up at one token, H200).
    # The default for token tiles up to SHARE_SM_MAX_WIDTH where M <= E (`choose_config`).
    share_sm: bool = False

    @property
    def owners(self) -> int:
        """Consumers owning distinct 64-row parts of the N block."""
        return 1 if self.split_k else self.compute_wgs

    @property
    def block_n(self) -> int:
        return ROWS * self.owners

    @property
    def widths(self) -> tuple[int, ...]:
        """The B widths an item may run with, narrowest first: the powers of two up to
        max_rows, then max_rows + last_extra."""
        out, w = [], MIN_WIDTH
        while w <= self.max_rows:
            out.append(w)
            w *= 2
        return tuple(out) + ((self.max_rows + self.last_extra,) if self.last_extra else ())

    @property
    def max_width(self) -> int:
        return self.widths[-1]


def _pow2_at_least(v: float) -> int:
    p = 1
    while p < v:
        p *= 2
    return p


def smem_bytes(cfg: Config, itemsize: int = 2, halves: int = 1, weight_bits: int | None = None,
               grouped: bool | int = False, interpret: bool = False, piece: int = PIECE) -> int:
    """Shared memory of a config; halves = 2 when each item streams a gate and an up block;
    weight_bits: quantized values' width (None: the weights are in x's dtype), grouped:
    with group-wise scales (an int: that many groups a piece, fp4); interpret: with the
    upcast boxes' buffer of interpret mode; piece: K columns per box."""
    w_rows = halves * cfg.block_n  # weight rows per piece
    w_bytes = w_rows * piece * (weight_bits or 8 * itemsize) // 8 + w_rows * 4 * int(grouped)
    ring = cfg.num_stages * cfg.k_pieces * (w_bytes + cfg.max_width * piece * itemsize)
    out = cfg.compute_wgs * cfg.max_width * ROWS * itemsize
    partial = halves * ROWS * cfg.max_width * 4 if cfg.split_k else 0
    upcast = (cfg.compute_wgs * cfg.k_pieces * halves * ROWS * piece * itemsize
              if interpret and weight_bits else 0)
    return ring + out + partial + upcast + 1024  # barriers and alignment


def num_sms() -> int:
    return gpu_sm_count(NUM_SMS)


def choose_config(m: int, e: int, n: int, k: int, sms: int = NUM_SMS,
                  swiglu: bool = False, weight_bits: int | None = None,
                  grouped: bool | int = False, interpret: bool = False,
                  piece: int = PIECE, words32: bool = False) -> Config:
    """Static heuristics from the shapes (group sizes are only known on the device).

    max_rows: about three times the mean rows per expert (M / E), so that even a busy
    expert of a decode step fits one window (its weight streamed once), at least 16 and
    at most 128 (128 x 128 CTA tiles), or 256 when experts average 512 rows or more
    (128 x 256 tiles; on an H100 256 ran Mixtral's 4096-token step 1.5x faster than 128,
    and Qwen3's, with 256 rows an expert, 12% slower: half-empty last windows). Never
    wider than x (a decode step of 8 rows: 8). One consumer warpgroup
    (64-row N blocks) when two would leave SMs idle: the few-token steps, where at
    most min(M, E) experts are hit. Two K pieces per step while the token tile is
    narrow (32 KB of weights per step keeps enough bytes in flight per SM), quantized
    ones as many as bring 16 KB (`_quantized_step`); then as many ring slots as fit, up
    to 8. Decode steps (M <= E, M <= MAX_ROW_ITEMS_M):
    max_rows >= M, so that every group fits one window and the items come from the
    per-row table (`row_items`). When groups span several 128-row windows, a last window
    of up to 32 rows joins the one before (`last_extra`). swiglu (N = 2 N'): the ring
    fits the gate and up blocks an item streams when its epilogue can fuse them.
    Quantized weights (weight_bits 8 or 4; pieces of `piece` K columns, `piece_cols`) keep
    the same tiles; their smaller boxes leave room for more ring slots. Where one consumer
    would own each N block and a step has two pieces (max_rows <= 64), two consumers
    split each step's pieces (`split_k`). If two ring slots still do not fit (interpret
    mode's upcast buffers at 256-row tiles), max_rows halves. words32 (the experts can be
    read as 32-bit words: int4 or fp4, bf16 rows, pieces of a multiple of 64): token tiles
    up to WORDS32_MAX_WIDTH take them (`Config.words32`); the per-row table only where
    fewer than half the experts can hold a row (2 M <= E); tiles up to SHARE_SM_MAX_WIDTH
    in steps of M <= E, two CTAs an SM (`Config.share_sm`).
    """
    mean_rows = m / e
    # 32-bit words pay for every token column of the tile in mma.sync issue slots: where
    # half the experts or more hold a row (2 M > E), windows of ~3 mean rows beat the
    # per-row table's M-wide ones (gpt-oss MXFP4 at 8 tokens, 32 rows: 16 against 32 rows,
    # 1.24x; Qwen3's 64 rows over 128 experts kept the table, H200).
    per_row = m <= min(MAX_ROW_ITEMS_M, e) and not (words32 and 2 * m > e)
    if per_row:  # every group fits one window: the per-row table
        max_rows = max(MIN_WIDTH, _pow2_at_least(m))
    else:
        max_rows = 256 if mean_rows >= 512 else min(128, max(16, _pow2_at_least(3 * mean_rows)))
        max_rows = min(max_rows, max(MIN_WIDTH, _pow2_at_least(m)))  # no wider than x
    # Groups over several windows (prefill): a last window of up to max_rows / 4 rows
    # joins the one before (Qwen3 at 4096 tokens: 256 +- 16 rows an expert).
    extra = max_rows // 4 if max_rows == 128 and mean_rows >= max_rows else 0
    hit = min(m, e)
    wgs = 2 if n % (2 * ROWS) == 0 and hit * (n // (2 * ROWS)) >= sms else 1
    pieces = 2 if max_rows <= 64 and k % (2 * piece) == 0 else 1
    # Quantized, one consumer's worth of N blocks: two consumers split K instead.
    split = bool(weight_bits) and wgs == 1 and pieces % 2 == 0
    cfg = Config(max_rows=max_rows, compute_wgs=2 if split else wgs, k_pieces=pieces,
                 num_stages=8, last_extra=extra, split_k=split)
    halves = 2 if swiglu and row_items(m, e, cfg) else 1

    def fitted(cfg, room, min_stages):
        """cfg with its K pieces a step and ring slots (then tile) fitted to `room` bytes."""
        def fits(cfg):
            return smem_bytes(cfg, 2, halves, weight_bits, grouped, interpret, piece) <= room
        if weight_bits and cfg.max_rows <= 64:
            box_bytes = ROWS * piece * weight_bits // 8
            cfg = _quantized_step(cfg, k // piece, halves * cfg.owners * box_bytes, fits,
                                  min_stages)
        while not fits(cfg) and cfg.num_stages > 2:
            cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
        while not fits(cfg) and cfg.max_rows > 2 * MIN_WIDTH and not row_items(m, e, cfg):
            cfg = dataclasses.replace(cfg, max_rows=cfg.max_rows // 2,
                                      last_extra=cfg.last_extra // 2)
        return cfg, fits(cfg)

    cfg, _ = fitted(cfg, SMEM_BYTES, 4)
    words32 = words32 and cfg.max_width <= WORDS32_MAX_WIDTH
    if words32 and cfg.max_width <= SHARE_SM_MAX_WIDTH and m <= e:
        # Two CTAs an SM (interpret mode keeps its few simulated CTAs), each ring in half
        # the shared memory, where that leaves it three slots or more.
        shared, fits = fitted(
            dataclasses.replace(cfg, k_pieces=pieces, num_stages=8, words32=True,
                                share_sm=True, num_ctas=None if interpret else 2 * sms),
            SMEM_BYTES // 2 - 1024, 3)
        if fits and shared.num_stages >= 3 and shared.max_rows == cfg.max_rows:
            return shared
    return dataclasses.replace(cfg, words32=words32)


def _quantized_step(cfg: Config, total_pieces: int, piece_bytes: int, fits,
                    min_stages: int = 4) -> Config:
    """K pieces a step for quantized weights in narrow token tiles: the fewest that bring
    QUANT_STEP_BYTES of weights (piece_bytes a piece), among the divisors of the pieces
    from cfg's up to 16 that leave two steps, keep split K's even count and fit
    `min_stages` ring slots; the most of those if none brings that much; cfg's if none
    qualifies. 4-bit boxes of 64 columns are 2 KB: gpt-oss's K (45 pieces) ran one piece
    a step, and 5 or 9 ran its MXFP4 experts 1.2-1.4x faster (bench/NOTES.md, Grouped
    matmul (Mosaic GPU))."""
    fitting = [d for d in range(cfg.k_pieces, 17)
               if total_pieces % d == 0 and total_pieces // d >= 2
               and (not cfg.split_k or d % 2 == 0)
               and fits(dataclasses.replace(cfg, k_pieces=d, num_stages=min_stages))]
    if not fitting:
        return cfg
    enough = [d for d in fitting if d * piece_bytes >= QUANT_STEP_BYTES]
    return dataclasses.replace(cfg, k_pieces=min(enough) if enough else max(fitting))


def _swizzled(bits: int = 16, cols: int = PIECE):
    """Pieces of `cols` `bits`-wide elements: 8-row tiles of up to 128 bytes a row, swizzled
    by that row (bf16/f16: 128 bytes, the swizzle wgmma reads; int8 and int4 pieces are
    read into registers)."""
    swizzle = min(128, cols * bits // 8)
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def piece_cols(w, k: int) -> int:
    """K columns per box: PIECE for float weights; QUANT_PIECE for quantized ones whose
    scale groups hold whole boxes (per channel, or groups of a multiple of it), else
    PIECE (groups of 64)."""
    if not isinstance(w, QuantizedWeight) or k % QUANT_PIECE:
        return PIECE
    return QUANT_PIECE if w.group_size % QUANT_PIECE == 0 else PIECE


def row_items(m: int, e: int, cfg: Config) -> bool:
    """Whether the kernel takes its items from the per-row table (`build_row_items`): when
    every group fits one window (M <= max_rows) and there are no more rows than experts.

    Why the second condition: item i runs (row i // n_blocks, N block); rows that start no
    group skip theirs, and CTAs take items round robin. With M <= E most rows start a group
    (one token's k experts are distinct), so every CTA gets about the same share. With
    many rows per expert (Mixtral: E = 8, 16 rows at 8 tokens) most items are skipped and
    the shares went uneven: Mixtral's down projection at 8 and 64 tokens ran 25-36% slower
    than with the item table (H200; bench/NOTES.md, Grouped matmul (Mosaic GPU): Per-row table
    for every step of M <= 128).
    """
    return m <= min(cfg.max_rows, e)


def _group_ends(group_sizes: jax.Array, m: int) -> jax.Array:
    """[E] int32: each group's end row, sizes[0] + ... + sizes[e] (at most M), as a
    compare-sum over [E, E]: one kernel, where XLA makes jnp.cumsum two reduce-windows."""
    g = jnp.arange(group_sizes.shape[0], dtype=jnp.int32)
    upto = g[None, :] <= g[:, None]
    return jnp.minimum(jnp.sum(jnp.where(upto, group_sizes.astype(jnp.int32)[None, :], 0),
                               axis=1), m)


def build_items(group_sizes: jax.Array, m: int, padded_m: int, n_blocks: int, cfg: Config):
    """(items [6, capacity] int32, count [1] int32): the work items of the module docstring,
    one column each, rows (group, N block, row start, rows, B width index, load start).

    Group E (one past the experts) is the zero tail: the rows from sum(group_sizes) to M.
    A group's row windows start at its first row rounded down to a multiple of 8: the TMA
    of a tiled shared-memory buffer addresses x in whole 8-row tiles, so a token window
    must start on one (the first window of a group then holds up to 7 rows of the group
    before it, which are not stored).

    Items run group by group, N block by N block, window minor: the CTAs working at one
    time share a few weight blocks (each read from HBM about once, then from L2 by the
    group's other windows) and the group's rows. Elementwise ops and gathers from [E + 1]
    arrays only (no searchsorted, whose loop is a chain of small kernels on the GPU), so
    XLA fuses the table into a few kernels.
    """
    e = group_sizes.shape[0]
    tile = cfg.max_rows
    ends = _group_ends(group_sizes, m)
    g_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])  # [E + 1]
    g_end = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
    g_base = g_start // MIN_WIDTH * MIN_WIDTH
    span = g_end - g_base
    windows = jnp.where(g_end > g_start, -(-span // tile), 0)
    # A last window of at most last_extra rows joins the one before it (its width
    # max_rows + last_extra): otherwise it streams the expert's weight block once more
    # for those few rows (prefill, ~256 rows an expert: 2 full windows and a short one).
    windows = windows - ((windows > 1) & (span - (windows - 1) * tile <= cfg.last_extra))
    # n_blocks x the windows' cumsum (not the cumsum of n_blocks x windows): the other
    # projection of the layer, with its own n_blocks, then shares the cumsum.
    item_end = jnp.cumsum(windows) * n_blocks
    item_begin = item_end - windows * n_blocks
    # At most min(E, M) experts have rows, plus the zero tail; each non-empty group's
    # windows cover its rows and up to 7 rows before them. At one decode token (M = k)
    # this bound is ~13x below the one for E + 1 groups, and so is the table.
    groups = min(e, m) + 1
    capacity = ((m + (MIN_WIDTH - 1) * groups) // tile + groups + 1) * n_blocks
    i = jnp.arange(capacity, dtype=jnp.int32)
    grp = jnp.minimum(jnp.sum(item_end[None, :] <= i[:, None], axis=1, dtype=jnp.int32), e)
    local = i - item_begin[grp]
    per_block = jnp.maximum(windows[grp], 1)
    n_block, window_index = local // per_block, local % per_block
    window = g_base[grp] + window_index * tile  # 8-row aligned
    row_start = jnp.maximum(window, g_start[grp])
    last = window_index == per_block - 1
    end = jnp.where(last, g_end[grp], jnp.minimum(window + tile, g_end[grp]))
    rows = jnp.clip(end - row_start, 0, tile + cfg.last_extra)
    needed = row_start - window + rows  # window rows up to the item's last row
    widths = jnp.asarray(cfg.widths, jnp.int32)
    width = jnp.sum(needed[:, None] > widths[None, :-1], axis=1, dtype=jnp.int32)
    # A window that would run past x slides back (still aligned: both ends are).
    load_start = jnp.where(grp < e, jnp.minimum(window, padded_m - widths[width]), row_start)
    items = jnp.stack([grp, n_block, row_start, rows, width, load_start])
    return items, item_end[-1:]


def build_row_items(group_sizes: jax.Array, m: int) -> RowGroups:
    """The per-row table, for M <= max_rows (every group fits one window): each row's
    group (E: the zero tail) and the group's span, from the group sizes (compare-sums
    over [E, E] and [M, E]); an MoE layer passes the same table from its sort instead.

    The kernel runs item (r, N block) = divmod(i, n_blocks) for the group whose first row
    is r, skips rows that start no group, and derives the item's window and B width from
    the group's span (`_row_item`). No cumsum over items, and the table does not depend
    on N, so a layer's two projections share it.
    """
    ends = _group_ends(group_sizes, m)
    before = ends[None, :] <= jnp.arange(m)[:, None]  # [M, E]: groups ended by row r
    grp = jnp.sum(before, axis=1, dtype=jnp.int32)  # row r's group (E: the tail)
    start = jnp.max(jnp.where(before, ends[None, :], 0), axis=1)
    end = jnp.min(jnp.where(before, m, ends[None, :]), axis=1)
    return RowGroups(grp, start, end)


def _row_item(table, row, num_experts: int, padded_m: int, cfg: Config):
    """(group, row start, rows, width index, load start) of the per-row item of `row`;
    group E + 1 when the row starts no group (its items are skipped)."""
    grp, start, end = (ref[row] for ref in table)
    grp = jnp.where(row == start, grp, num_experts + 1)
    base = lax.div(start, jnp.int32(MIN_WIDTH)) * MIN_WIDTH
    widths = cfg.widths
    width = sum(jnp.where(end - base > w, 1, 0) for w in widths[:-1])  # the narrowest fit
    width_rows = widths[0] + sum(jnp.where(width > i, widths[i + 1] - widths[i], 0)
                                 for i in range(len(widths) - 1))
    # A window that would run past x slides back (still aligned: both ends are).
    load_start = jnp.where(grp < num_experts, jnp.minimum(base, padded_m - width_rows), start)
    return grp, start, end - start, width, load_start


def _kernel(table, count_ref, x_ref, w_ref, scales_ref, out_ref, w_smem, x_smem, o_smem,
            s_smem, a_smem, p_smem, ready, free, handoff, *, cfg: Config, num_experts: int,
            steps: int, grid: int, row_blocks: int | None, padded_m: int, swiglu: bool,
            aligned: bool, scales: str | None, group_size: int, piece: int,
            fp4_groups: int = 0, words32: bool = False):
    """table: the item table's ref (`build_items`) when row_blocks is None; else the
    per-row table's refs (`build_row_items`), and row_blocks the N blocks: item i is
    (row, N block) = divmod(i, row_blocks).

    swiglu: each item streams its N block of the gate rows and the same block of the up
    rows (N' = out_ref's width further on) into two accumulators, and stores
    silu(gate) * up; w_smem holds the gate boxes at [.., c] and the up boxes at
    [.., owners + c].

    aligned: every item's rows start and end on 8-row boundaries of x and of its tile
    (`groups_aligned`), and o_smem is swizzled: the output boxes are whole 8-row tiles.

    scales: None for float weights; "channel": quantized w_ref, scales_ref [E, N / 64, 64]
    float32, applied to the accumulators; "group": quantized w_ref, scales_ref
    [E, K / group_size, N], a row per piece brought into s_smem [stages, pieces, boxes, 64]
    beside the weight boxes. piece: K columns per box (64, or 128 for quantized weights).
    a_smem: interpret mode's upcast boxes [wgs, pieces, halves, 64, piece].

    fp4_groups: fp4 weights (`jaxinfer.mosaic.nibble_words`), that many scale groups a piece:
    w_ref holds uint16 words [E, N, K / 4], x_ref x's word blocks [K / 16, M, 16], and the
    boxes are [64, 16] words, [4, width, 16] tokens and [groups, 64] scales a piece.

    words32: 4-bit weights as uint32 words [E, N, K / 8] in [64, piece / 8] boxes, x's
    columns in `quant.chunk_order`, products by mma.sync (`Config.words32`); fp4
    scales still [groups, 64] a box.

    cfg.split_k: consumer c takes pieces c, c + 2, ... of every step; the second writes its
    accumulators to p_smem [halves, 64, max_width] float32 and the first adds them
    (handoff barriers: [0] the partial sums are written, [1] they were read)."""
    cta, wg = lax.axis_index("cta"), lax.axis_index("wg")
    wgs, stages, pieces = cfg.compute_wgs, cfg.num_stages, cfg.k_pieces
    owners = cfg.owners
    mine = 0 if cfg.split_k else wg  # this consumer's part of the N block
    halves = 2 if swiglu else 1
    n_out = out_ref.shape[1]
    count = count_ref[0]
    my_items = jnp.maximum(count - cta + grid - 1, 0) // grid
    words16 = fp4_groups and not words32  # fp4 as 16-bit words, x in four word blocks
    word_cols = (nibble_words.PER_WORD if words16
                 else nibble_words.WORD32_CODES if words32 else 1)  # K elements a column

    def fields(j):
        i = cta + j * grid
        if row_blocks is None:
            return tuple(table[f, i] for f in range(6))
        row, n_block = lax.div(i, row_blocks), lax.rem(i, row_blocks)
        grp, row_start, rows, width, load_start = _row_item(table, row, num_experts,
                                                            padded_m, cfg)
        return grp, n_block, row_start, rows, width, load_start

    def advance(g, grp):
        """The ring position after an item: its steps, if it loaded any."""
        return g + jnp.where(grp < num_experts, steps, 0)

    @pl.when(wg == wgs)
    def _producer():
        if not cfg.share_sm:
            plgpu.set_max_registers(40, action="decrease")

        def load_tokens(load_start, k0, slot, p, w):
            if not words16:
                plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(load_start, w), pl.ds(k0, piece)],
                                        x_smem.at[slot, p, pl.ds(0, w)], ready.at[slot])
                return
            # The piece's four word blocks, one copy each (a TMA's shared-memory side must
            # be contiguous, and w rows of each block are not, together).
            block0 = lax.div(k0, nibble_words.WORDS)
            for nib in range(nibble_words.PER_WORD):
                plgpu.copy_gmem_to_smem(x_ref.at[block0 + nib, pl.ds(load_start, w)],
                                        x_smem.at[slot, p, nib, pl.ds(0, w)], ready.at[slot])

        def item(j, g):
            grp, n_block, _, _, width, load_start = fields(j)

            @pl.when(grp < num_experts)
            def _():
                def step(s, _):
                    gs = g + s
                    slot = lax.rem(gs, stages)

                    @pl.when(gs >= stages)
                    def _():
                        plgpu.barrier_wait(free.at[slot])
                    for p in range(pieces):
                        k0 = pl.multiple_of((s * pieces + p) * piece, piece)
                        # one 64 x piece box per part of the N block (and half: gate, up)
                        for half, c in itertools.product(range(halves), range(owners)):
                            row0 = pl.multiple_of(
                                half * n_out + (n_block * owners + c) * ROWS, ROWS)
                            box = half * owners + c
                            cols = pl.ds(lax.div(k0, word_cols), piece // word_cols)
                            plgpu.copy_gmem_to_smem(w_ref.at[grp, pl.ds(row0, ROWS), cols],
                                                    w_smem.at[slot, p, box], ready.at[slot])
                            if fp4_groups:  # the piece's groups of scales
                                plgpu.copy_gmem_to_smem(
                                    scales_ref.at[grp, pl.ds(lax.div(k0, group_size),
                                                             fp4_groups), pl.ds(row0, ROWS)],
                                    s_smem.at[slot, p, box], ready.at[slot])
                            elif scales == "group":  # the rows' scales for this piece
                                plgpu.copy_gmem_to_smem(
                                    scales_ref.at[grp, lax.div(k0, group_size),
                                                  pl.ds(row0, ROWS)],
                                    s_smem.at[slot, p, box], ready.at[slot])
                        for wi, w in enumerate(cfg.widths):  # the item's width only
                            pl.when(width == wi)(functools.partial(
                                load_tokens, load_start, k0, slot, p, w))
                    return ()

                lax.fori_loop(0, steps, step, ())
            return advance(g, grp)

        total = lax.fori_loop(0, my_items, item, jnp.int32(0))

        # Observe the consumers' last hand-backs too: every phase of a barrier is then
        # waited for by each thread that uses it (interpret mode checks this).
        def drain(gs, _):
            plgpu.barrier_wait(free.at[lax.rem(gs, stages)])
            return ()

        lax.fori_loop(jnp.maximum(total - stages, 0), total, drain, ())

    @pl.when(wg < wgs)
    def _consumer():
        if not cfg.share_sm:
            plgpu.set_max_registers(232, action="increase")
        o_tile = o_smem.at[wg]

        def store_rows(row_start, rows, shift, col0):
            """TMA-stores o_tile[shift:shift + rows] to out[row_start:row_start + rows]:
            one box per binary digit of rows (boxes have static shapes)."""
            def store_box(src, dst, box):
                plgpu.copy_smem_to_gmem(o_tile.at[pl.ds(src, box)],
                                        out_ref.at[pl.ds(dst, box), pl.ds(col0, ROWS)])

            done, box = 0, cfg.max_rows
            while box >= (MIN_WIDTH if aligned else 1):
                pl.when((rows & box) != 0)(functools.partial(
                    store_box, shift + done, row_start + done, box))
                done = done + (rows & box)
                box //= 2  # (rows < 2 * max_rows: the digits from max_rows down)

        def weights(slot, p, half, j):
            """wgmma's A operand for this consumer's weight box of piece p (the j-th piece
            it takes this step) and half: the box itself (float weights), or the box upcast
            to x's dtype in registers and scaled by its group's scales (in interpret mode,
            written to its own upcast buffer)."""
            box = half * owners + mine
            if scales is None:
                return w_smem.at[slot, p, box]
            # The upcast register layout (int4 loads in it too), then wgmma's A layout.
            a = plgpu.load(w_smem.at[slot, p, box], (), layout=plgpu.Layout.WGMMA_UPCAST_2X)
            a = plgpu.layout_cast(a.astype(x_smem.dtype), plgpu.Layout.WGMMA)
            if scales == "group":
                # Dequantised before the MMA, so that every piece accumulates into one
                # accumulator (one multiply per weight, in x's dtype).
                scale = plgpu.load(s_smem.at[slot, p, box], (),
                                   layout=plgpu.Layout.WGMMA.reduce(1))
                a = a * lax.broadcast_in_dim(scale.astype(a.dtype), a.shape, [0])
            if a_smem is not None:  # interpret mode: wgmma's A operand must be in SMEM
                a_smem.at[wg, j, half][...] = a
                plgpu.commit_smem()
                return a_smem.at[wg, j, half]
            return a

        def fp4_mmas(acc_refs, slot, p, j, w):
            """The four nibbles' wgmmas of piece p (`jaxinfer.mosaic.nibble_words`), each
            upcast and issued in turn (interpret mode reuses one upcast buffer)."""
            for half, acc_ref in enumerate(acc_refs):
                box = half * owners + mine
                words = plgpu.load(w_smem.at[slot, p, box], (), layout=plgpu.Layout.WGMMA)
                group_scales = nibble_words.group_scales(
                    lambda i, box=box: plgpu.load(s_smem.at[slot, p, box, i], (),
                                                  layout=plgpu.Layout.WGMMA.reduce(1)),
                    fp4_groups, words.shape)
                for nib in range(nibble_words.PER_WORD):
                    a = nibble_words.nibble_weights(words, nib, group_scales, a_smem is not None)
                    if a_smem is not None:  # interpret mode: wgmma's A operand in SMEM
                        a_smem.at[wg, j, half][...] = a
                        plgpu.commit_smem()
                        a = a_smem.at[wg, j, half]
                    plgpu.wgmma(acc_ref, a, x_smem.at[slot, p, nib, pl.ds(0, w)].transpose((1, 0)))

        # This consumer's pieces of every step: all, or every other one (split_k).
        taken = ([j * wgs + wg for j in range(pieces // wgs)] if cfg.split_k
                 else list(range(pieces)))

        def words32_accs(g, w):
            """The item's products by mma.sync, one float32 value per half [64, w] (in
            WGMMA's layout, as the epilogue takes them)."""
            acc_layout = plgpu.Layout.MMA_ACC(x_smem.dtype)
            rhs = plgpu.Layout.MMA_RHS(x_smem.dtype)
            word_layout = plgpu.Layout.MMA_LHS(jnp.float32)  # (a uint32 word's, too)

            def zeros():
                return plgpu.layout_cast(jnp.zeros((ROWS, w), jnp.float32), acc_layout)

            def step(s, accs):
                gs = g + s
                slot = lax.rem(gs, stages)
                plgpu.barrier_wait(ready.at[slot])
                accs = list(accs)
                for p in taken:
                    x_tile = x_smem.at[slot, p, pl.ds(0, w)]
                    x_t = (x_tile[...].T if a_smem is not None else
                           plgpu.load(x_tile.transpose((1, 0)), (), layout=rhs))
                    for half in range(halves):
                        box = half * owners + mine
                        words = plgpu.load(w_smem.at[slot, p, box], (),
                                           layout=plgpu.Layout.MMA_LHS(jnp.uint32))
                        if fp4_groups:  # each word's group scale, in the words' layout
                            word_scales = nibble_words.group_scales(
                                lambda i, box=box, p=p: plgpu.load(
                                    s_smem.at[slot, p, box, i], (),
                                    layout=word_layout.reduce(1)),
                                fp4_groups, words.shape, layout=word_layout,
                                dtype=jnp.float32)
                            accs[half] = nibble_words.words32_mma(
                                accs[half], words, x_t, a_smem is not None, word_scales)
                        elif scales == "group":  # on the piece's float32 partial sums
                            part = nibble_words.words32_mma(zeros(), words, x_t,
                                                            a_smem is not None)
                            row_scale = plgpu.load(s_smem.at[slot, p, box], (),
                                                   layout=acc_layout.reduce(1))
                            accs[half] = accs[half] + part * lax.broadcast_in_dim(
                                row_scale, part.shape, [0])
                        else:
                            accs[half] = nibble_words.words32_mma(accs[half], words, x_t,
                                                                  a_smem is not None)

                @pl.when(s > 0)  # the previous step's slot goes back, as `mma`'s
                def _():
                    plgpu.barrier_arrive(free.at[lax.rem(gs + stages - 1, stages)])
                return tuple(accs)

            accs = lax.fori_loop(0, steps, step, tuple(zeros() for _ in range(halves)))
            if a_smem is not None:  # interpret mode: layouts are ignored
                return accs
            return tuple(plgpu.layout_cast(acc, plgpu.Layout.WGMMA) for acc in accs)

        def mma(*acc_refs, g, w):
            """One accumulator per half (gate, up); returns their values."""
            def step(s, _):
                gs = g + s
                slot = lax.rem(gs, stages)
                plgpu.barrier_wait(ready.at[slot])
                if fp4_groups:
                    for j, p in enumerate(taken):
                        fp4_mmas(acc_refs, slot, p, j, w)
                else:
                    # Every A operand of the step first (quantized: upcast into registers).
                    a_ops = [[weights(slot, p, half, j) for half in range(halves)]
                             for j, p in enumerate(taken)]
                    for j, p in enumerate(taken):
                        x_tile = x_smem.at[slot, p, pl.ds(0, w)].transpose((1, 0))
                        for half, acc_ref in enumerate(acc_refs):
                            plgpu.wgmma(acc_ref, a_ops[j][half], x_tile)
                if scales is not None:
                    # Register A operands are not left in flight past the step: with the
                    # next step's upcasts running under them, token tiles of 64 rows and
                    # more gave wrong sums and NaNs on an H200 (jax's mixed-type matmul
                    # waits likewise, after each MMA). The other consumer, if any, keeps
                    # the tensor core busy meanwhile.
                    plgpu.wgmma_wait(0)
                # This step's MMAs may still run; the previous step's are done, so its
                # slot goes back to the producer.
                plgpu.wgmma_wait(len(taken) * halves
                                 * (nibble_words.PER_WORD if fp4_groups else 1))

                @pl.when(s > 0)
                def _():
                    plgpu.barrier_arrive(free.at[lax.rem(gs + stages - 1, stages)])
                return ()

            lax.fori_loop(0, steps, step, ())
            return tuple(acc_ref[...] for acc_ref in acc_refs)

        def item(j, g):
            grp, n_block, row_start, rows, width, load_start = fields(j)
            col0 = (n_block * owners + mine) * ROWS

            def store_tile(values, w, shift):
                """values [ROWS features, w tokens] float32 -> out rows (transposed)."""
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # o_tile free again
                o_tile.at[pl.ds(0, w)].transpose((1, 0))[...] = values.astype(o_tile.dtype)
                plgpu.commit_smem()
                store_rows(row_start, rows, shift, col0)

            # (split_k: the first consumer stores the tile both computed)
            @pl.when((grp == num_experts) & (wg == 0 if cfg.split_k else True))
            def _zero_tail():
                if aligned:  # (a splat cannot be stored to the swizzled tile)
                    zeros = jnp.zeros((ROWS, cfg.max_width), jnp.float32)
                    store_tile(plgpu.layout_cast(zeros, plgpu.Layout.WGMMA), cfg.max_width, 0)
                else:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # o_tile free again
                    o_tile[...] = jnp.zeros(o_tile.shape, o_tile.dtype)
                    plgpu.commit_smem()
                    store_rows(row_start, rows, 0, col0)

            def expert_item(w):
                if scales == "channel":  # loaded first: its latency hides behind the MMAs
                    row_scales = [plgpu.load(
                        scales_ref.at[grp, half * (n_out // ROWS) + n_block * owners + mine],
                        (), layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
                        for half in range(halves)]
                if words32:
                    accs = words32_accs(g, w)
                else:
                    accs = pl.run_scoped(functools.partial(mma, g=g, w=w),
                                         *[plgpu.ACC((ROWS, w), jnp.float32)] * halves)
                plgpu.barrier_arrive(free.at[lax.rem(g + steps - 1, stages)])

                def finish(accs):
                    if fp4_groups:  # the scales' power of two not in the weights
                        accs = [acc * jnp.float32(2.0 ** nibble_words.SUM_EXP) for acc in accs]
                    if scales == "channel":
                        accs = [acc * lax.broadcast_in_dim(scale, acc.shape, [0])
                                for acc, scale in zip(accs, row_scales, strict=True)]
                    if swiglu:  # silu(gate) * up, in float32
                        gate, up = accs
                        acc = gate / (1.0 + jnp.exp(-gate)) * up
                    else:
                        (acc,) = accs
                    store_tile(acc, w, row_start - load_start)

                if not cfg.split_k:
                    finish(accs)
                    return

                @pl.when(wg == 1)
                def _hand_over():
                    for half, acc in enumerate(accs):
                        p_smem.at[half, :, pl.ds(0, w)][...] = acc
                    plgpu.barrier_arrive(handoff.at[0])
                    plgpu.barrier_wait(handoff.at[1])  # read: p_smem free again

                @pl.when(wg == 0)
                def _take_over():
                    plgpu.barrier_wait(handoff.at[0])
                    total = [acc + plgpu.load(p_smem.at[half, :, pl.ds(0, w)], (),
                                              layout=plgpu.Layout.WGMMA, optimized=False)
                             for half, acc in enumerate(accs)]
                    plgpu.barrier_arrive(handoff.at[1])
                    finish(total)

            for wi, w in enumerate(cfg.widths):  # the item's width only
                pl.when((grp < num_experts) & (width == wi))(functools.partial(expert_item, w))
            return advance(g, grp)

        lax.fori_loop(0, my_items, item, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)


# Jitted so that call sites with the same shapes (a model's layers) share one lowering.
@functools.partial(jax.jit, static_argnames=("swiglu", "rows_sorted", "groups_aligned",
                                             "config"))
def grouped_matmul_mgpu(x: jax.Array, w: jax.Array | QuantizedWeight, group_sizes: jax.Array,
                        row_groups: RowGroups | None = None, *, swiglu: bool = False,
                        rows_sorted: bool = True, groups_aligned: bool = False,
                        config: Config | None = None) -> jax.Array:
    """x [M, K], W [E, N, K] (float, or a quantized stack), group_sizes [E] -> [M, N]
    (see the module docstring). row_groups: the per-row table (`build_row_items`), if the
    caller has it; rows_sorted False: the rows are not in group order (`RowGroups`).
    swiglu: W holds gate rows, then up rows -> silu(gate) * up [M, N / 2]; fused into the kernel's
    epilogue on the per-row path (decode), applied after the kernel otherwise (the two
    [64, width] accumulators of a prefill tile would not fit the registers).
    groups_aligned: the caller promises group sizes in multiples of 8 rows (the fast
    epilogue; ignored where M is not a multiple of 8 or the per-row table is used)."""
    if (reason := unsupported_reason(x, w)) is not None:
        raise ValueError(f"mosaic grouped matmul: {reason}")
    if isinstance(w, QuantizedWeight) and not upcasts_in_registers(w, x.dtype):
        # Whole-stack dequantisation: a cost for prefill sizes; the registry reduces decode
        # rows of these formats by row instead (`jaxinfer.ops.grouped_matmul_registry`).
        w = dequantize(w, x.dtype)
    m, k = x.shape
    e, n, _ = w.shape
    interpret = mosaic_interpret_params()
    quantized = isinstance(w, QuantizedWeight)
    weight_bits, scales, piece, fp4_groups = weight_form(w, k)
    groups = fp4_groups or scales == "group"  # scale rows a box brings
    cfg = config or default_config(x, w, swiglu)
    # (gate and up blocks of block_n rows each: N / 2 must hold whole blocks)
    fused = swiglu and row_items(m, e, cfg) and (n // 2) % cfg.block_n == 0
    halves = 2 if fused else 1
    # A consumer hands a slot back only after issuing the next step: two slots at least.
    if (cfg.max_rows not in (8, 16, 32, 64, 128, 256) or cfg.compute_wgs not in (1, 2)
            or cfg.split_k and (cfg.compute_wgs != 2 or cfg.k_pieces % 2)
            or cfg.num_stages < 2 or cfg.last_extra % MIN_WIDTH
            or not 0 <= cfg.last_extra < cfg.max_rows or cfg.max_width > MAX_WIDTH
            or n % (halves * cfg.block_n) or k % (cfg.k_pieces * piece)):
        raise ValueError(f"mosaic grouped matmul: config {cfg} does not tile "
                         f"M={m} N={n} K={k}")
    smem = smem_bytes(cfg, x.dtype.itemsize, halves, weight_bits, groups,
                      interpret is not None, piece)
    if smem > SMEM_BYTES:
        raise ValueError(f"mosaic grouped matmul: config {cfg} needs {smem} bytes of "
                         "shared memory")
    steps = k // (cfg.k_pieces * piece)
    n_out = n // halves
    n_blocks = n_out // cfg.block_n
    # Every token window lies inside x, in whole 8-row tiles.
    padded_m = max(-(-m // MIN_WIDTH) * MIN_WIDTH, cfg.max_width)
    x_in = jnp.pad(x, ((0, padded_m - m), (0, 0))) if padded_m > m else x
    if not rows_sorted and row_groups is None:
        raise ValueError("mosaic grouped matmul: rows_sorted=False needs row_groups")
    if not rows_sorted and not row_items(m, e, cfg):
        # The item table walks the rows in group order.
        return in_group_order(lambda x: grouped_matmul_mgpu(
            x, w, group_sizes, swiglu=swiglu, config=config), x, row_groups)
    words32 = cfg.words32
    if cfg.share_sm and not words32:
        raise ValueError("mosaic grouped matmul: share_sm takes words32 (mma.sync) consumers")
    if words32 and not (quantized and nibble_words.takes_words32(w.kind, x.dtype, piece)):
        raise ValueError("mosaic grouped matmul: words32 takes int4 or fp4 experts, bf16 "
                         f"rows and pieces of a multiple of 64 (here {piece})")
    if words32:  # words of eight codes; x's columns in the chunks' order
        values, x_in = nibble_words.words32(w.values), chunk_order(x_in)
        scale_rows = (w.scales.reshape(e, n // ROWS, ROWS) if scales == "channel"
                      else w.scales)
    elif fp4_groups:  # words of four codes; x's columns in the nibbles' order
        values, x_in = nibble_words.words(w.values), nibble_words.x_word_blocks(x_in)
        scale_rows = w.scales
    elif quantized:
        values = w.values
        # Per channel: [E, 1, N] -> one row of 64 scales per consumer's N block.
        scale_rows = (w.scales.reshape(e, n // ROWS, ROWS) if scales == "channel"
                      else w.scales)
    else:
        values, scale_rows = w, None
    # Whole 8-row output tiles (see `_kernel`): every group and the zero tail in them.
    aligned = groups_aligned and m % GROUP_ALIGN == 0 and not row_items(m, e, cfg)
    if row_items(m, e, cfg):
        items = build_row_items(group_sizes, m) if row_groups is None else row_groups
        row_blocks = n_blocks
        capacity = m * n_blocks
        count = jnp.full((1,), capacity, jnp.int32)
    else:
        items, count = build_items(group_sizes, m, padded_m, n_blocks, cfg)
        capacity, row_blocks = items.shape[1], None
    default_ctas = INTERPRET_CTAS if interpret is not None else num_sms()
    grid = max(1, min(cfg.num_ctas or default_ctas, capacity))

    stages, pieces, wgs = cfg.num_stages, cfg.k_pieces, cfg.compute_wgs
    boxes = halves * cfg.owners  # weight boxes per piece
    if words32:  # [64, piece / 8] words, [width, piece] tokens
        cols = piece // nibble_words.WORD32_CODES
        w_box, x_box, a_cols = (ROWS, cols), (cfg.max_width, piece), piece
        s_box = (fp4_groups, ROWS) if fp4_groups else (ROWS,)
        w_transforms, x_transforms = _swizzled(32, cols), _swizzled(16, piece)
    elif fp4_groups:  # [64, 16] words, [4, width, 16] tokens, [groups, 64] scales a box
        words = nibble_words.WORDS
        w_box, x_box, a_cols = (ROWS, words), (nibble_words.PER_WORD, cfg.max_width, words), words
        s_box = (fp4_groups, ROWS)
        w_transforms = x_transforms = _swizzled(16, words)
    else:
        w_box, x_box, a_cols, s_box = (ROWS, piece), (cfg.max_width, piece), piece, (ROWS,)
        w_transforms, x_transforms = _swizzled(weight_bits or 16, piece), _swizzled(16, piece)
    scratch = [
        plgpu.SMEM((stages, pieces, boxes, *w_box), values.dtype, transforms=w_transforms),
        plgpu.SMEM((stages, pieces, *x_box), x.dtype, transforms=x_transforms),
        plgpu.SMEM((wgs, cfg.max_width, ROWS), x.dtype,
                   transforms=_swizzled() if aligned else ()),
        plgpu.SMEM((stages, pieces, boxes, *s_box), jnp.float32) if groups else None,
        plgpu.SMEM((wgs, pieces, halves, ROWS, a_cols), x.dtype,
                   transforms=_swizzled(16, a_cols))
        if quantized and interpret is not None else None,
        plgpu.SMEM((halves, ROWS, cfg.max_width), jnp.float32) if cfg.split_k else None,
        # ready: per piece, a weight box (and its scales) per consumer and half, and the
        # token rows (fp4: in four blocks)
        plgpu.Barrier(num_arrivals=(boxes * (2 if groups else 1)
                                    + (nibble_words.PER_WORD if fp4_groups and not words32
                                       else 1)) * pieces,
                      num_barriers=stages),
        plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),  # free: each consumer
        plgpu.Barrier(num_arrivals=1, num_barriers=2) if cfg.split_k else None,  # handoff
    ]
    kernel = functools.partial(_kernel, cfg=cfg, num_experts=e, steps=steps, grid=grid,
                               row_blocks=row_blocks, padded_m=padded_m, swiglu=fused,
                               aligned=aligned, scales=scales,
                               group_size=w.group_size if quantized else k, piece=piece,
                               fp4_groups=fp4_groups, words32=words32)

    def body(table, count_ref, x_ref, w_ref, *refs):
        scales_ref, refs = (refs[0], refs[1:]) if quantized else (None, refs)
        kernel(table, count_ref, x_ref, w_ref, scales_ref, *refs)

    operands = (items, count, x_in, values) + ((scale_rows,) if quantized else ())
    y = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n_out), x.dtype),
        scratch_types=scratch,
        grid=(grid,), grid_names=("cta",),
        num_threads=wgs + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )(*operands)
    return swiglu_halves(y, x.dtype) if swiglu and not fused else y


def weight_form(w, k: int) -> tuple[int | None, str | None, int, int]:
    """Experts w [E, N, K] as the kernel streams them: (weight_bits: None for float;
    scales: None, "channel" or "group"; piece: K columns a box, `piece_cols`; fp4_groups:
    the scale groups a box holds for fp4, else 0)."""
    piece = piece_cols(w, k)
    if not isinstance(w, QuantizedWeight):
        return None, None, piece, 0
    bits = 4 if w.kind in ("int4", "fp4") else 8
    scales = "channel" if w.group_size == k else "group"
    return bits, scales, piece, piece // w.group_size if w.kind == "fp4" else 0


def default_config(x: jax.Array, w, swiglu: bool = False) -> Config:
    """The config `grouped_matmul_mgpu` picks for x [M, K] and experts w (float, or
    quantized ones it upcasts in registers: `upcasts_in_registers`), from `choose_config`."""
    (m, k), (e, n, _) = x.shape, w.shape
    bits, scales, piece, fp4_groups = weight_form(w, k)
    interpret = mosaic_interpret_params() is not None
    words32 = bits == 4 and nibble_words.takes_words32(w.kind, x.dtype, piece)
    return choose_config(m, e, n, k, NUM_SMS if interpret else num_sms(), swiglu, bits,
                         fp4_groups or scales == "group", interpret, piece, words32)


def upcasts_in_registers(w: QuantizedWeight, x_dtype=None) -> bool:
    """Whether the kernel streams these quantized weights as stored and upcasts them in
    registers: symmetric int8 / int4, per channel or in groups of a multiple of PIECE;
    MXFP4 / NVFP4 against bf16 x (`jaxinfer.mosaic.nibble_words`; x_dtype None: bf16).
    Others (fp8, zero points, groups of 32, fp4 against f16 x) it takes dequantised into a
    float stack by XLA first."""
    if w.kind == "fp4":
        return x_dtype in (None, jnp.bfloat16)
    return (w.kind in ("int8", "int4") and w.offsets is None
            and (w.group_size == w.shape[2] or w.group_size % PIECE == 0))


def unsupported_reason(x: jax.Array, w) -> str | None:
    """Why this kernel cannot take these inputs (None if it can)."""
    if (reason := stored_order_reason(w)) is not None:
        return reason
    if x.dtype not in (jnp.bfloat16, jnp.float16):
        return f"x dtype {x.dtype}: needs bfloat16 or float16"
    if not isinstance(w, QuantizedWeight) and w.dtype != x.dtype:
        return f"weights in {w.dtype}, x in {x.dtype}: needs one dtype"
    _, n, k = w.shape
    if n % ROWS or k % PIECE:
        return f"N={n} and K={k} must be multiples of {ROWS} and {PIECE}"
    return None
