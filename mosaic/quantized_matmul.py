"""Weight-quantized matmul for Hopper, as a Mosaic GPU kernel (`plgpu.kernel`).

Same contract as `jaxinfer.ops.linear.quantized_matmul_reference` (the
spec): x [M, K] bf16/f16, W a `QuantizedWeight` (values [N, K] int8 or int4,
scales [K // g, N] f32, optional offsets) -> y [M, N] in x.dtype.

Algorithm (the transposed product y^T = W x^T, so the weight is wgmma's A):
- Operands swap: the weight tile is the register A operand (M = 64 weight rows
  per CTA), the token tile is B (N = `tile_m` tokens, 8 or 16), so a
  decode batch of 1..16 tokens wastes no tensor-core rows on padding beyond
  the 8-token minimum, and the weight streams through once.
- K is cut into pieces of `piece` columns (the group size for group-wise
  scales, else 128). Per pipeline step a producer warpgroup issues one TMA per
  piece for the weight rows and one for the token rows (and one for the step's
  group scales) into a `num_stages`-deep ring.
- Two consumer warpgroups take alternate pieces of each step (a K split inside
  the CTA, so one's upcast overlaps the other's MMAs). Each loads its pieces
  from shared memory in the WGMMA_UPCAST_2X register layout, upcasts them to
  the activation dtype in registers, multiplies group-wise pieces by their
  per-row scales, relays them out as wgmma's A operand and accumulates into one
  accumulator for the whole K loop; a step's slot returns to the producer once
  the next step's MMAs are issued and its own have finished. Per-channel scales
  are applied once at the end.
- Or (`Config.mma_sync`, the default for 4-bit weights in 8-token tiles) each warp
  of a consumer runs mma.sync m16n8k16 on its 16 of the 64 weight rows: the pieces
  load straight into the MMA_LHS layout and upcast there (no relayout), the tokens
  load transposed from the same shared tile, group scales multiply each piece's
  float32 partial sums, and the accumulator is a loop value. With `Config.words32`
  (int4, fp4 with bf16 x; the default under mma.sync where pieces allow) the codes load
  as 32-bit words in the operand layout and become bf16 two at a time
  (`nibble_words.words32_mma`). int4 values stored in the chunks' order at load
  (`QuantizedWeight.k_order`, on Hopper: `jaxinfer.ops.linear_registry.kernel_k_order`)
  take x as it is; otherwise x's columns are permuted to match, a kernel of its own where
  no neighbour fuses it.
- Split-K over the grid fills the SMs when N / 64 alone would not. Every
  (split, consumer) writes float32 partial sums [64, tile_m]; XLA adds them up,
  transposes back to [M, N] and, for asymmetric formats, adds the offset term
  (x summed over each group) @ offsets, a [M, K/g] x [K/g, N] product.
- The kernel takes any M, in 16-token tiles; the linear registry sends steps of more
  than 16 tokens to XLA (`jaxinfer.ops.linear_registry.MAX_KERNEL_M`).

fp4 weights (MXFP4, NVFP4: e2m1 codes, which Hopper cannot convert) are made bf16 with
integer ops (`jaxinfer.mosaic.nibble_words`): as 32-bit words under mma.sync where
`Config.words32` applies, else read as 16-bit words of four codes in pieces of 64 K
elements, four MMAs a piece, one per nibble, against x's permuted columns; XLA multiplies
the partial sums by 2^SUM_EXP.

On a machine without a GPU the same kernel runs in Mosaic GPU interpret mode
(tests); there the upcast weight piece goes through shared memory, because
interpret mode has no register A operand. Constraints (else
`unsupported_reason`): weight-only int8 / int4 / fp4, x in bf16 or fp16 (fp4: bf16),
N a multiple of 64, K a multiple of the piece (the group size or 128; fp4: 64).
fp8 weights go to XLA: W8A8 runs as XLA's fp8 dot (cuBLASLt), and e4m3 has no
direct upcast to bf16 in registers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jaxinfer.mosaic import nibble_words
from jaxinfer.ops.platform import mosaic_interpret_params
from jaxinfer.ops.quant import K_CHUNKS, QuantizedWeight, chunk_order, from_chunk_order

ROWS = 64  # weight rows per consumer warpgroup (the wgmma M tile)
NUM_SMS = 132  # H100 SXM; only used to pick the number of K splits
SMEM_BYTES = 227 * 1024


@dataclasses.dataclass(frozen=True)
class Config:
    tile_m: int = 16  # tokens per CTA (wgmma N): 8 or 16 (MAX_TILE_M)
    pieces_per_step: int = 4  # K pieces per pipeline step (a multiple of compute_wgs)
    num_stages: int = 4  # steps in flight
    compute_wgs: int = 2  # consumer warpgroups per CTA (1 or 2), splitting each step's pieces
    k_splits: int = 1  # K splits across CTAs (split-K)
    # Warp-level mma.sync (m16n8k16: each warp its 16 of the 64 weight rows) in place of
    # wgmma. A wgmma m64n8k16 with a register operand took ~90 SM cycles whatever its N (8
    # or 16) and however many warpgroups issued them, which caps the wgmma form at ~3 T
    # weights/s on 132 SMs: int4 at ~45% of the H200's bytes floor (bench/NOTES.md, Linear
    # and quantized matmul: mma.sync in place of wgmma). With mma.sync, group scales
    # multiply each piece's float32 partial sums [64, tile_m] instead of its weights, and a
    # step's slot goes back to the producer as soon as its products return.
    mma_sync: bool = False
    # With mma_sync, int4 or fp4 (bf16 x, pieces of a multiple of 64) read as 32-bit words
    # in the MMA operand layout and made bf16 two at a time (`nibble_words.words32_mma`);
    # x's columns permuted to match. The default where it applies: 1.04-1.10x mma.sync on
    # 16-bit loads for int4 g128 and 1.36x the 16-bit fp4 words at one token (H200).
    words32: bool = False
    # With mma_sync: no register hand-over between warpgroups (`set_max_registers`), so
    # that every thread keeps ptxas's own count and two CTAs can share an SM where their
    # shared memory fits (the mma.sync consumers' accumulators are a few registers; with
    # the hand-over the launch takes 168 a thread, one CTA an SM, ~3 warps a scheduler).
    share_sm: bool = False


# Token tiles wider than 16 give wrong sums on the GPU at times (tile_m 32 failed one GPU
# run of three, 64 every time; interpret mode is exact): an unexplained race, so tiles
# stop at 16 (bench/NOTES.md, Linear and quantized matmul: Token tiles of 32 or 64). The
# kernel still takes any M, in 16-token tiles.
MAX_TILE_M = 16


def piece_size(w: QuantizedWeight) -> int:
    """K elements per piece: the group size, or 128 for per-channel scales; fp4's 64
    (`nibble_words.PIECE`: 16 16-bit words, a k16 MMA per nibble) hold several groups."""
    g = w.group_size
    if w.kind == "fp4":
        return nibble_words.PIECE
    if g == w.shape[1]:
        return 128
    return g


def _smem_bytes(cfg: Config, piece: int, value_bits: int, x_bytes: int, scales_per_piece: int,
                interpret: bool) -> int:
    per_piece = ROWS * piece * value_bits // 8 + cfg.tile_m * piece * x_bytes
    per_piece += ROWS * 4 * scales_per_piece
    fixed = cfg.compute_wgs * ROWS * (cfg.tile_m * 4 + (piece * x_bytes if interpret else 0))
    return fixed + cfg.num_stages * cfg.pieces_per_step * per_piece + 1024


def choose_config(m: int, n: int, k: int, piece: int, value_bits: int, x_bytes: int = 2,
                  scales_per_piece: int = 0, interpret: bool = False,
                  words32: bool = False) -> Config:
    """Static heuristics for the memory-bound regime (small M): split K until the grid
    covers the SMs once (a second wave of one-CTA-per-SM blocks would idle the tail), then
    about 32 KB of weights per step, four steps in flight, two consumer warpgroups; 4-bit
    weights in 8-token tiles take mma.sync (1.05-1.23x wgmma at one token on the H200;
    16-token tiles and int8 not yet timed with it), reading them as 32-bit words where
    they can be (words32: int4 or fp4, bf16 x, pieces of a multiple of 64), 16 KB a step
    (int4 g128 1.02-1.08x 32 KB at one token; MXFP4's best was 16 KB too); over a wave
    of CTAs, mma.sync consumers keep ptxas's registers so that two CTAs share an SM
    (`Config.share_sm`)."""
    tile_m = max(8, -(-min(m, MAX_TILE_M) // 8) * 8)
    mma_sync = value_bits == 4 and tile_m == 8
    words32 = words32 and mma_sync
    total_pieces = k // piece
    wgs = 2 if total_pieces % 2 == 0 else 1
    ctas = (n // ROWS) * -(-m // tile_m)
    splits = 1  # each split keeps at least two steps of one piece per consumer
    while ctas * splits * 2 <= NUM_SMS and total_pieces % (splits * 2 * 2 * wgs) == 0:
        splits *= 2
    per_split = total_pieces // splits
    step_bytes = 16384 if words32 else 32768
    pps = wgs * max(1, min(8 // wgs, step_bytes // (ROWS * piece * value_bits // 8) // wgs))
    while per_split % pps or per_split // pps < 2 and pps > wgs:
        pps -= wgs
    # More CTAs than SMs under mma.sync: two a SM (Llama-3-8B's fused int4 gate_up, 448
    # CTAs: 1.14x at one token, H200); under a wave it changed nothing.
    share_sm = mma_sync and ctas * splits > NUM_SMS
    cfg = Config(tile_m=tile_m, pieces_per_step=pps, num_stages=4, compute_wgs=wgs,
                 k_splits=splits, mma_sync=mma_sync, words32=words32, share_sm=share_sm)
    while _smem_bytes(cfg, piece, value_bits, x_bytes, scales_per_piece, interpret) > SMEM_BYTES:
        if cfg.num_stages > 2:
            cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
        elif cfg.pieces_per_step > wgs and per_split % (cfg.pieces_per_step // 2) == 0 \
                and (cfg.pieces_per_step // 2) % wgs == 0:
            cfg = dataclasses.replace(cfg, pieces_per_step=cfg.pieces_per_step // 2)
        else:
            break
    return cfg


def _transforms(dtype, cols: int):
    """Shared-memory tiling + the widest swizzle a row fills (rows under 32 bytes, int4
    groups of 32, stay plain: they are only read into registers, never by wgmma)."""
    bits = 4 if dtype == jnp.int4 else jnp.dtype(dtype).itemsize * 8
    row_bytes = cols * bits // 8
    for s in (128, 64, 32):
        if row_bytes % s == 0:
            return (plgpu.TilingTransform((8, s * 8 // bits)), plgpu.SwizzleTransform(s))
    return ()


def _kernel(w_ref, x_ref, scales_ref, out_ref, scratch, *, cfg: Config, scales_per_piece: int,
            fp4_words: bool, fp4: bool, steps: int, interpret: bool):
    """scales_per_piece: 0 (per-channel scales, applied at the end), 1 (a group a piece)
    or the groups a piece holds (fp4). fp4_words: fp4 values read as 16-bit words
    (`nibble_words`); cfg.words32: 4-bit values (fp4 or int4) as 32-bit words."""
    w_smem, x_smem, s_smem, o_smem, a_smem, ready, free = scratch
    n_blk, m_blk, split = lax.axis_index("n"), lax.axis_index("m"), lax.axis_index("split")
    wg = lax.axis_index("wg")
    pps, stages, wgs = cfg.pieces_per_step, cfg.num_stages, cfg.compute_wgs
    first_piece = split * (steps * pps)
    grouped = scales_per_piece > 0

    @pl.when(wg == wgs)
    def _producer():
        if not cfg.share_sm:
            plgpu.set_max_registers(40, action="decrease")

        def produce(step, _):
            slot = lax.rem(step, jnp.int32(stages))

            @pl.when(step >= stages)
            def _():
                plgpu.barrier_wait(free.at[slot])
            p0 = first_piece + step * pps
            for p in range(pps):
                plgpu.copy_gmem_to_smem(w_ref.at[n_blk, :, p0 + p, :],
                                        w_smem.at[slot, p], ready.at[slot])
                x_src = x_ref.at[m_blk, p0 + p] if fp4_words else x_ref.at[m_blk, :, p0 + p, :]
                plgpu.copy_gmem_to_smem(x_src, x_smem.at[slot, p], ready.at[slot])
            if grouped:
                plgpu.copy_gmem_to_smem(scales_ref.at[pl.ds(p0, pps), :, n_blk, :],
                                        s_smem.at[slot], ready.at[slot])
            return ()

        lax.fori_loop(0, steps, produce, ())

    def sync_consumer():
        if not cfg.share_sm:
            plgpu.set_max_registers(232, action="increase")
        dtype = x_smem.dtype
        lhs, rhs, acc_layout = (plgpu.Layout.MMA_LHS(dtype), plgpu.Layout.MMA_RHS(dtype),
                                plgpu.Layout.MMA_ACC(dtype))
        rows_layout = acc_layout.reduce(1)  # a value per weight row, as the accumulator

        def mma(acc, w, x_tile):
            """acc [64, tm] f32 + w [64, k] @ x_tile^T ([tm, k] in shared memory)."""
            if interpret:  # interpret mode has no mma.sync; layouts are ignored there
                return acc + jnp.dot(w.astype(jnp.float32),
                                     x_tile[...].astype(jnp.float32).T)
            return plgpu.mma(acc, w, plgpu.load(x_tile.transpose((1, 0)), (), layout=rhs))

        def zeros():
            return plgpu.layout_cast(jnp.zeros((ROWS, cfg.tile_m), jnp.float32), acc_layout)

        def words32_product(acc, slot, p):
            if interpret:
                x_tiles = x_smem.at[slot, p][...].T
            else:
                x_tiles = plgpu.load(x_smem.at[slot, p].transpose((1, 0)), (), layout=rhs)
            word_array = plgpu.load(w_smem.at[slot, p], (),
                                    layout=plgpu.Layout.MMA_LHS(jnp.uint32))
            scales = None
            if fp4:  # each word's group scale, in the words' layout
                word_layout = plgpu.Layout.MMA_LHS(jnp.float32)
                scales = nibble_words.group_scales(
                    lambda g: plgpu.load(s_smem.at[slot, p, g], (),
                                         layout=word_layout.reduce(1)),
                    scales_per_piece, word_array.shape, layout=word_layout,
                    dtype=jnp.float32)
            return nibble_words.words32_mma(acc, word_array, x_tiles, interpret, scales)

        def step(i, acc):
            slot = lax.rem(i, jnp.int32(stages))
            plgpu.barrier_wait(ready.at[slot])
            for j in range(0, pps, wgs):
                p = j + wg if wgs > 1 else j
                if cfg.words32:
                    if grouped and not fp4:
                        part = words32_product(zeros(), slot, p)
                        scale = plgpu.load(s_smem.at[slot, p, 0], (), layout=rows_layout)
                        acc = acc + part * lax.broadcast_in_dim(scale, part.shape, [0])
                    else:
                        acc = words32_product(acc, slot, p)
                    continue
                if fp4_words:
                    word_array = plgpu.load(w_smem.at[slot, p], (), layout=lhs)
                    scales = nibble_words.group_scales(
                        lambda g, slot=slot, p=p: plgpu.load(
                            s_smem.at[slot, p, g], (), layout=lhs.reduce(1)),
                        scales_per_piece, word_array.shape, layout=lhs)
                    for nib in range(nibble_words.PER_WORD):
                        w = nibble_words.nibble_weights(word_array, nib, scales, interpret)
                        acc = mma(acc, w, x_smem.at[slot, p, nib])
                    continue
                w = plgpu.load(w_smem.at[slot, p], (), layout=lhs).astype(dtype)
                if grouped:  # the piece's group scale on its float32 partial sums
                    part = mma(zeros(), w, x_smem.at[slot, p])
                    scale = plgpu.load(s_smem.at[slot, p, 0], (), layout=rows_layout)
                    acc = acc + part * lax.broadcast_in_dim(scale, part.shape, [0])
                else:
                    acc = mma(acc, w, x_smem.at[slot, p])

            # mma.sync is done with the slot once it returns.
            @pl.when(i + stages < steps)
            def _():
                plgpu.barrier_arrive(free.at[slot])
            return acc

        acc = lax.fori_loop(0, steps, step, zeros())
        if not grouped:
            scale = plgpu.load(scales_ref.at[0, 0, n_blk], (), layout=rows_layout,
                               optimized=False)
            acc = acc * lax.broadcast_in_dim(scale, acc.shape, [0])
        o_smem.at[wg][...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[wg], out_ref.at[split * wgs + wg, n_blk, m_blk])
        plgpu.wait_smem_to_gmem(0)

    def wgmma_consumer():
        plgpu.set_max_registers(232, action="increase")

        def a_operand(w):
            if interpret:  # interpret mode: wgmma's A operand must be in SMEM
                a_smem.at[wg][...] = w
                plgpu.commit_smem()
                return a_smem.at[wg]
            return w

        def weight_piece(slot, p):
            """Piece p of the slot's weight rows, upcast (and group-scaled) in registers."""
            # The upcast register layout (int4 also loads in it: the 4X layout's wider
            # loads plus a regrouping measured no faster), then wgmma's A layout.
            w = plgpu.load(w_smem.at[slot, p], (), layout=plgpu.Layout.WGMMA_UPCAST_2X)
            w = plgpu.layout_cast(w.astype(x_smem.dtype), plgpu.Layout.WGMMA)
            if grouped:
                # Dequantise before the MMA (one multiply per weight) so that every piece
                # accumulates into one accumulator without waiting on the tensor core.
                scale = plgpu.load(s_smem.at[slot, p, 0], (),
                                   layout=plgpu.Layout.WGMMA.reduce(1))
                w = w * lax.broadcast_in_dim(scale.astype(w.dtype), w.shape, [0])
            return a_operand(w)

        def mma(acc_ref):
            # Warpgroup wg takes pieces wg, wg + wgs, ... of every step (a split of K
            # inside the CTA: consumers overlap one another's upcasts and MMAs).
            def step(i, _):
                slot = lax.rem(i, jnp.int32(stages))
                plgpu.barrier_wait(ready.at[slot])
                mine = range(0, pps, wgs)
                for j in mine:
                    p = j + wg if wgs > 1 else j
                    if fp4_words:
                        word_array = plgpu.load(w_smem.at[slot, p], (),
                                                layout=plgpu.Layout.WGMMA)
                        scales = nibble_words.group_scales(
                            lambda g, slot=slot, p=p: plgpu.load(
                                s_smem.at[slot, p, g], (), layout=plgpu.Layout.WGMMA.reduce(1)),
                            scales_per_piece, word_array.shape)
                        for nib in range(nibble_words.PER_WORD):
                            w = nibble_words.nibble_weights(word_array, nib, scales, interpret)
                            plgpu.wgmma(acc_ref, a_operand(w),
                                        x_smem.at[slot, p, nib].transpose((1, 0)))
                    else:
                        plgpu.wgmma(acc_ref, weight_piece(slot, p),
                                    x_smem.at[slot, p].transpose((1, 0)))
                # This step's MMAs may still run; the previous step's are done, so its
                # slot goes back to the producer (if the producer will refill it).
                plgpu.wgmma_wait(len(mine) * (nibble_words.PER_WORD if fp4_words else 1))

                @pl.when((i > 0) & (i - 1 + stages < steps))
                def _():
                    plgpu.barrier_arrive(free.at[lax.rem(i + stages - 1, jnp.int32(stages))])
                return ()

            lax.fori_loop(0, steps, step, ())
            return acc_ref[...]

        acc = pl.run_scoped(mma, plgpu.ACC((ROWS, cfg.tile_m), jnp.float32))
        if not grouped:
            scale = plgpu.load(scales_ref.at[0, 0, n_blk], (),
                               layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
            acc = acc * lax.broadcast_in_dim(scale, acc.shape, [0])
        o_smem.at[wg][...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[wg], out_ref.at[split * wgs + wg, n_blk, m_blk])
        plgpu.wait_smem_to_gmem(0)

    pl.when(wg < wgs)(sync_consumer if cfg.mma_sync else wgmma_consumer)


def default_config(x: jax.Array, w: QuantizedWeight) -> Config:
    """The config `quantized_matmul_mgpu` picks for x [M, K] and w (`choose_config`)."""
    (m, k), n, piece = x.shape, w.shape[0], piece_size(w)
    return choose_config(m, n, k, piece, 4 if w.kind in ("int4", "fp4") else 8,
                         x.dtype.itemsize, _scales_per_piece(w, piece),
                         mosaic_interpret_params() is not None,
                         nibble_words.takes_words32(w.kind, x.dtype, piece))


def tiles(cfg: Config, k: int, piece: int) -> bool:
    """Whether cfg cuts K (in pieces of `piece`) into whole steps of every K split, each
    step's pieces shared evenly by its consumers, in a token tile the kernel takes."""
    return not ((k // piece) % (cfg.pieces_per_step * cfg.k_splits)
                or cfg.pieces_per_step % cfg.compute_wgs or cfg.compute_wgs not in (1, 2)
                or cfg.tile_m % 8 or cfg.tile_m > MAX_TILE_M)


def _scales_per_piece(w: QuantizedWeight, piece: int) -> int:
    """0 for per-channel scales, else the scale groups a piece holds."""
    return 0 if w.group_size == w.shape[1] else max(1, piece // w.group_size)


# Jitted so that call sites with the same shapes (a model's layers) share one lowering.
@functools.partial(jax.jit, static_argnames=("config",))
def quantized_matmul_mgpu(x: jax.Array, w: QuantizedWeight, *,
                          config: Config | None = None) -> jax.Array:
    """x [M, K] @ W^T -> [M, N] in x.dtype (see the module docstring)."""
    if (reason := unsupported_reason(x, w)) is not None:
        raise ValueError(f"mosaic quantized matmul: {reason}")
    m, k = x.shape
    n = w.shape[0]
    fp4 = w.kind == "fp4"
    piece = piece_size(w)
    scales_per_piece = _scales_per_piece(w, piece)
    interpret = mosaic_interpret_params()
    cfg = config or default_config(x, w)
    words32 = cfg.words32
    if words32 and (not nibble_words.takes_words32(w.kind, x.dtype, piece)
                    or not cfg.mma_sync):
        raise ValueError("mosaic quantized matmul: words32 takes int4 or fp4 weights, "
                         f"bf16 x, pieces of a multiple of 64 (here {piece}) and mma_sync")
    if cfg.share_sm and not cfg.mma_sync:  # (wgmma's consumers need the hand-over)
        raise ValueError("mosaic quantized matmul: share_sm takes mma_sync consumers")
    fp4_words = fp4 and not words32  # fp4 otherwise read as 16-bit words
    pps, wgs, tm, stages = cfg.pieces_per_step, cfg.compute_wgs, cfg.tile_m, cfg.num_stages
    total_pieces = k // piece
    if not tiles(cfg, k, piece):
        raise ValueError(f"mosaic quantized matmul: config {cfg} does not tile "
                         f"M={m} N={n} K={k} (piece {piece})")
    steps = total_pieces // (pps * cfg.k_splits)
    stages = min(stages, steps)
    cfg = dataclasses.replace(cfg, num_stages=stages)
    n_blocks, m_tiles = n // ROWS, -(-m // tm)

    # Views whose TMA offsets fall on untiled (leading) dimensions only.
    x_pad = jnp.pad(x, ((0, m_tiles * tm - m), (0, 0)))
    chunked = w.k_order == K_CHUNKS  # values stored in the chunks' order at load
    if chunked and not words32:  # read in stored order: x's columns permuted to match
        x_pad = from_chunk_order(x_pad)
    if fp4_words:
        # Words of four codes; x's piece columns 4c + i gathered into nibble i's block.
        values, wp = nibble_words.words(w.values), piece // nibble_words.PER_WORD
        w_view = values.reshape(n_blocks, ROWS, total_pieces, wp)
        x_view = nibble_words.x_word_blocks(x_pad, piece).reshape(
            total_pieces, nibble_words.PER_WORD, m_tiles, tm, wp).transpose(2, 0, 1, 3, 4)
        w_tile, x_tile = (ROWS, wp), (nibble_words.PER_WORD, tm, wp)
    elif words32:
        # Words of eight codes; each 64-column tile of x in its chunks' order, unless the
        # values were stored in that order (then chunk column L is K element L).
        values, wp = nibble_words.words32(w.values), piece // nibble_words.WORD32_CODES
        w_view = values.reshape(n_blocks, ROWS, total_pieces, wp)
        x_chunks = x_pad if chunked else chunk_order(x_pad)
        x_view = x_chunks.reshape(m_tiles, tm, total_pieces, piece)
        w_tile, x_tile = (ROWS, wp), (tm, piece)
    else:
        values = w.values
        w_view = values.reshape(n_blocks, ROWS, total_pieces, piece)
        x_view = x_pad.reshape(m_tiles, tm, total_pieces, piece)
        w_tile, x_tile = (ROWS, piece), (tm, piece)
    # [pieces, scales a piece, N / 64, 64] (per-channel: [1, 1, N / 64, 64])
    scales_view = w.scales.reshape(-1, max(scales_per_piece, 1), n_blocks, ROWS)

    scratch = [
        plgpu.SMEM((stages, pps, *w_tile), values.dtype,
                   transforms=_transforms(values.dtype, w_tile[-1])),
        plgpu.SMEM((stages, pps, *x_tile), x.dtype, transforms=_transforms(x.dtype, x_tile[-1])),
        plgpu.SMEM((stages, pps, scales_per_piece, ROWS), jnp.float32)
        if scales_per_piece else None,
        plgpu.SMEM((wgs, ROWS, tm), jnp.float32),
        plgpu.SMEM((wgs, ROWS, w_tile[-1] if fp4_words else piece), x.dtype,
                   transforms=_transforms(x.dtype, w_tile[-1] if fp4_words else piece))
        if interpret else None,
    ]
    copies = 2 * pps + (1 if scales_per_piece else 0)
    barriers = (plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
                plgpu.Barrier(num_arrivals=wgs, num_barriers=stages))
    kernel_fn = functools.partial(_kernel, cfg=cfg, scales_per_piece=scales_per_piece,
                                  fp4_words=fp4_words, fp4=fp4, steps=steps,
                                  interpret=interpret is not None)

    def entry(w_ref, x_ref, s_ref, out_ref):
        pl.run_scoped(lambda *s: kernel_fn(w_ref, x_ref, s_ref, out_ref, (*s[0], *s[1:])),
                      scratch, *barriers, collective_axes="wg")

    partial = plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((cfg.k_splits * wgs, n_blocks, m_tiles, ROWS, tm),
                                      jnp.float32),
        grid=(n_blocks, m_tiles, cfg.k_splits), grid_names=("n", "m", "split"),
        num_threads=wgs + 1, thread_name="wg", interpret=interpret,
    )(w_view, x_view, scales_view)
    # [splits, N / 64, m_tiles, 64, tm] -> [M, N]
    y = partial.sum(axis=0).transpose(1, 3, 0, 2).reshape(m_tiles * tm, n)[:m]
    if fp4:
        y = y * jnp.float32(2.0 ** nibble_words.SUM_EXP)
    if w.offsets is not None:
        g = w.group_size
        x_sums = x.astype(jnp.float32).reshape(m, k // g, g).sum(axis=-1)
        y = y + jnp.dot(x_sums, w.offsets, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def unsupported_reason(x: jax.Array, w: QuantizedWeight) -> str | None:
    """Why this kernel cannot take these inputs (None if it can)."""
    n, k = w.shape
    if w.kind not in ("int8", "int4", "fp4"):
        return f"{w.kind} weights go to XLA (fp8 dot / dequantize)"
    if x.dtype not in (jnp.bfloat16, jnp.float16):
        return f"x dtype {x.dtype}: needs bfloat16 or float16"
    if w.kind == "fp4" and x.dtype != jnp.bfloat16:
        return f"x dtype {x.dtype}: fp4 weights need bfloat16 (their bits are made as bf16)"
    piece = piece_size(w)
    if n % ROWS or k % piece:
        return f"N={n} must be a multiple of {ROWS} and K={k} of {piece}"
    return None
