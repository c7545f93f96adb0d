"""Ragged paged attention: Pallas kernel, TPU lowering (interpret mode elsewhere).

Same contract as `jaxinfer.ops.attention.ragged_paged_attention_reference` (the
spec; layouts in that module's docstring):
  q [T, Hq, D], k / v [T, Hkv, D] (this step's tokens), k_pages / v_pages
  [num_pages, page_size, Hkv, D] in q.dtype or float8_e4m3fn (per-layer float
  k_scale / v_scale), AttentionMetadata(cu_q_lens [S+1], kv_lens [S],
  page_indices [S, P], num_seqs [1]). Returns (out [T, Hq, D] in q.dtype,
  k_pages, v_pages). head_dim 64 / 128 / 256; Hq a multiple of Hkv (G = Hq / Hkv).

Algorithm:
  1. The new k/v are scattered into the pages by XLA (`write_kv_pages`, in
     place when the caller donates the pages); the kernel only reads pages.
  2. The wrapper cuts every live sequence's queries into *tiles* of `q_block`
     tokens (a tile never spans two sequences) and gathers them into
     q_tiles [W, Hkv, q_block * G, D]: for each KV head, the G query heads of
     its group stacked row-wise (row r = token r // G, head r % G), so GQA is
     one [q_block * G, D] x [D, kv] matmul per KV head. W is a static bound on
     the tile count; the spare tiles have no live rows and skip all work.
  3. Grid = (W,): one step per tile, all KV heads. The work list (sequence,
     position of the tile's first token, live rows) and kv_lens / flattened
     page_indices are scalar-prefetched into SMEM. The pages stay in HBM
     (memory_space=ANY); the step walks the KV blocks the tile can see
     (`pages_per_block` pages each; causal end, sliding-window start), copying
     each block's pages with manual DMAs into a 2-slot VMEM buffer: block j + 1
     is in flight while block j is computed.
  4. Online softmax (flash attention) in float32. A sink is a virtual key with
     logit sinks[h] and value 0: the running max / denominator start from it.
     Cache slots past the visible range (stale buffer slots, NaN poison past
     kv_len) are zeroed in K and V, not only masked in the scores, because
     0 * NaN = NaN in the PV matmul.
  5. The output tiles are gathered back to token order; padding tokens get 0.

fp8 pages are DMA'd as fp8 (half the bytes) and upcast to q.dtype in VMEM;
k_scale folds into the softmax scale and v_scale multiplies the output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxinfer.ops.attention import FP8_KV_DTYPE, AttentionMetadata, token_positions, write_kv_pages
from jaxinfer.ops.platform import tpu_interpret_params


def _kernel(
    # Scalar prefetch (SMEM).
    kv_lens_ref,  # [S]
    page_indices_ref,  # [S * P]: flat, as 2-D SMEM arrays pad their last dim
    tile_seq_ref,  # [W] sequence of each tile
    tile_pos_ref,  # [W] cache position of each tile's first token
    tile_len_ref,  # [W] live rows (tokens) of each tile; 0 for spare tiles
    # Inputs.
    q_ref,  # [Hkv, R, D] VMEM, R = q_block * G
    sinks_ref,  # [Hkv, R, 1] float32 VMEM (unused without sinks)
    k_hbm,  # [num_pages, page_size, Hkv, D] HBM
    v_hbm,
    # Output.
    o_ref,  # [Hkv, R, D] VMEM
    # Scratch.
    k_buf,  # [2, pages_per_block, page_size, Hkv, D] VMEM: double buffer
    v_buf,
    sems,  # DMA semaphores [2 (k, v), 2 (slot)]
    *,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    use_sinks: bool,
    v_scale: float | None,
    group: int,
    pages_per_seq: int,
):
    num_kv_heads, rows, head_dim = q_ref.shape
    _, ppb, page_size, _, _ = k_buf.shape
    block_kv = ppb * page_size
    w = pl.program_id(0)
    seq = tile_seq_ref[w]
    pos0 = tile_pos_ref[w]
    n_live = tile_len_ref[w]
    # Causality: the tile's last token sees positions < kv_end (<= kv_lens[seq]).
    kv_end = jnp.minimum(pos0 + n_live, kv_lens_ref[seq])
    kv_start = 0 if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0)
    n_pages = pl.cdiv(kv_end, page_size)  # pages holding visible positions
    first_blk = kv_start // block_kv
    last_blk = jnp.where(n_live > 0, pl.cdiv(kv_end, block_kv), first_blk)  # exclusive

    def fetch(blk, method):
        """Starts ("start") or waits for ("wait") the page DMAs of KV block `blk`.

        Block j goes to buffer slot j % 2. Only pages holding visible positions are
        copied: the other slots keep stale data, which the masks zero.
        """
        slot = blk % 2
        for i in range(ppb):
            p = blk * ppb + i
            # The clamp only keeps the SMEM read in bounds for pages that are not copied.
            page = page_indices_ref[seq * pages_per_seq + jnp.minimum(p, pages_per_seq - 1)]
            copies = (
                pltpu.make_async_copy(k_hbm.at[page], k_buf.at[slot, i], sems.at[0, slot]),
                pltpu.make_async_copy(v_hbm.at[page], v_buf.at[slot, i], sems.at[1, slot]),
            )

            @pl.when(p < n_pages)
            def _(copies=copies):
                for copy in copies:
                    getattr(copy, method)()

    @pl.when(first_blk < last_blk)
    def _():
        fetch(first_blk, "start")

    # Row r is token r // group of the tile, at cache position q_pos.
    q_pos = pos0 + lax.broadcasted_iota(jnp.int32, (rows, block_kv), 0) // group
    kv_iota = lax.broadcasted_iota(jnp.int32, (rows, block_kv), 1)
    kv_row_iota = lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0)

    def body(blk, carry):
        @pl.when(blk + 1 < last_blk)
        def _():
            fetch(blk + 1, "start")  # in flight while this block is computed

        fetch(blk, "wait")
        slot = blk % 2
        kv_pos = blk * block_kv + kv_row_iota
        live_kv = kv_pos < kv_end  # [block_kv, 1]
        col = blk * block_kv + kv_iota
        mask = (col <= q_pos) & (col < kv_end)
        if sliding_window is not None:
            mask &= q_pos - col < sliding_window
        new_carry = []
        for h in range(num_kv_heads):
            m_prev, l_prev, acc_prev = carry[h]
            # Head h of every slot of the block (whole pages were copied: one DMA each).
            k = k_buf[slot, :, :, h, :].reshape(block_kv, head_dim)
            v = v_buf[slot, :, :, h, :].reshape(block_kv, head_dim)
            if k.dtype != q_ref.dtype:  # fp8: upcast via float32 (exact)
                k = k.astype(jnp.float32).astype(q_ref.dtype)
                v = v.astype(jnp.float32).astype(q_ref.dtype)
            k = jnp.where(live_kv, k, 0)
            v = jnp.where(live_kv, v, 0)
            s = lax.dot_general(q_ref[h], k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = jnp.where(mask, s, -jnp.inf)
            m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
            # Rows that have seen nothing yet keep m = -inf: shift by 0 instead.
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp(s - m_safe)
            alpha = jnp.exp(m_prev - m_safe)
            l_new = alpha * l_prev + p.sum(axis=1, keepdims=True)
            pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
            new_carry.append((m_new, l_new, alpha * acc_prev + pv))
        return tuple(new_carry)

    init = []
    for h in range(num_kv_heads):
        if use_sinks:  # the sink as key 0: max = its logit, denominator = exp(0)
            m0 = sinks_ref[h]
            l0 = jnp.ones((rows, 1), jnp.float32)
        else:
            m0 = jnp.full((rows, 1), -jnp.inf, jnp.float32)
            l0 = jnp.zeros((rows, 1), jnp.float32)
        init.append((m0, l0, jnp.zeros((rows, head_dim), jnp.float32)))
    final = lax.fori_loop(first_blk, last_blk, body, tuple(init))

    for h in range(num_kv_heads):
        _, l_fin, acc = final[h]
        out = acc / jnp.where(l_fin == 0.0, 1.0, l_fin)  # rows with no visible key: 0
        if v_scale is not None:
            out = out * v_scale
        o_ref[h] = out.astype(o_ref.dtype)


def _work_list(md: AttentionMetadata, num_tokens: int, q_block: int):
    """Tiles of <= q_block tokens of one live sequence each, padded to a static count W.

    Returns (tile_seq, tile_start (token index in q), tile_pos, tile_len, tile_first),
    where tile_first[s] is the first tile of sequence s. Padding sequences
    (s >= num_seqs) get no tiles whatever their metadata says.
    """
    S = md.kv_lens.shape[0]
    seqs = jnp.arange(S, dtype=jnp.int32)
    cu = md.cu_q_lens
    q_lens = jnp.where(seqs < md.num_seqs[0], cu[1:] - cu[:-1], 0)
    n_tiles = pl.cdiv(q_lens, q_block)
    tile_end = jnp.cumsum(n_tiles)
    tile_first = tile_end - n_tiles
    # sum_s cdiv(q_len_s, q_block) < T / q_block + S, and every tile holds a token.
    W = min(num_tokens, pl.cdiv(num_tokens, q_block) + S)
    tiles = jnp.arange(W, dtype=jnp.int32)
    tile_seq = jnp.minimum(jnp.searchsorted(tile_end, tiles, side="right"), S - 1)
    offset = (tiles - tile_first[tile_seq]) * q_block  # first token of the tile in its seq
    live = tiles < tile_end[-1]
    tile_len = jnp.where(live, jnp.clip(q_lens[tile_seq] - offset, 0, q_block), 0)
    tile_start = cu[tile_seq] + offset
    tile_pos = md.kv_lens[tile_seq] - q_lens[tile_seq] + offset
    return (tile_seq.astype(jnp.int32), tile_start, tile_pos.astype(jnp.int32),
            tile_len.astype(jnp.int32), tile_first)


def ragged_paged_attention_tpu(
    q, k, v, k_pages, v_pages, md: AttentionMetadata, *,
    sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
    sinks: jax.Array | None = None, k_scale: float | None = None, v_scale: float | None = None,
    q_block: int | None = None, pages_per_block: int | None = None,
):
    """Writes k/v into the pages, then attends with the Pallas kernel.

    Returns (out [T, Hq, D] in q.dtype, k_pages, v_pages). On TPU the kernel is
    compiled by Mosaic; elsewhere it runs in TPU interpret mode (for tests).
    `q_block` (tokens per tile) and `pages_per_block` (pages per KV block) default
    to MXU-sized blocks on TPU and to small ones in interpret mode, which keeps the
    CPU tests fast and makes them cross KV-block (double-buffer) boundaries.
    """
    k_pages, v_pages = write_kv_pages(k, v, k_pages, v_pages, md, k_scale=k_scale,
                                      v_scale=v_scale)
    T, Hq, D = q.shape
    S, P = md.page_indices.shape
    _, page_size, Hkv, _ = k_pages.shape
    G = Hq // Hkv
    on_tpu = jax.default_backend() == "tpu"
    q_block = q_block or (32 if on_tpu else 8)
    pages_per_block = min(P, pages_per_block or (max(1, 256 // page_size) if on_tpu else 2))
    rows = q_block * G
    fp8 = k_pages.dtype == FP8_KV_DTYPE
    scale = sm_scale * (k_scale if fp8 and k_scale is not None else 1.0)

    tile_seq, tile_start, tile_pos, tile_len, tile_first = _work_list(md, T, q_block)
    W = tile_seq.shape[0]
    # q_tiles [W, Hkv, q_block * G, D]: row i * G + g is token i, query head h * G + g.
    tok = jnp.clip(tile_start[:, None] + jnp.arange(q_block), 0, T - 1)
    q_tiles = (q[tok].reshape(W, q_block, Hkv, G, D).transpose(0, 2, 1, 3, 4)
               .reshape(W, Hkv, rows, D))
    if sinks is None:
        sink_rows = jnp.zeros((Hkv, rows, 1), jnp.float32)
    else:
        sink_rows = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(Hkv, 1, G),
                                     (Hkv, q_block, G)).reshape(Hkv, rows, 1)

    kernel = functools.partial(
        _kernel, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
        use_sinks=sinks is not None, v_scale=v_scale if fp8 else None, group=G,
        pages_per_seq=P)
    tile_spec = pl.BlockSpec((None, Hkv, rows, D), lambda w, *_: (w, 0, 0, 0))
    kv_buf = pltpu.VMEM((2, pages_per_block, page_size, Hkv, D), k_pages.dtype)
    out_tiles = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(W,),
            in_specs=[
                tile_spec,
                pl.BlockSpec((Hkv, rows, 1), lambda w, *_: (0, 0, 0)),
                pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=tile_spec,
            scratch_shapes=[kv_buf, kv_buf, pltpu.SemaphoreType.DMA((2, 2))],
        ),
        out_shape=jax.ShapeDtypeStruct((W, Hkv, rows, D), q.dtype),
        # Every tile fetches its own first block, so tiles are independent.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=tpu_interpret_params(),
        name="ragged_paged_attention",
    )(md.kv_lens, md.page_indices.reshape(-1), tile_seq, tile_pos, tile_len,
      q_tiles, sink_rows, k_pages, v_pages)

    # Back to token order: token t of sequence s is row (t - cu[s]) % q_block of tile
    # tile_first[s] + (t - cu[s]) // q_block.
    out_tiles = (out_tiles.reshape(W, Hkv, q_block, G, D).transpose(0, 2, 1, 3, 4)
                 .reshape(W, q_block, Hq, D))
    token_seq, _, valid = token_positions(md, T)
    local = jnp.arange(T, dtype=jnp.int32) - md.cu_q_lens[token_seq]
    tile = jnp.clip(tile_first[token_seq] + local // q_block, 0, W - 1)
    out = out_tiles[tile, local % q_block]
    out = jnp.where(valid[:, None, None], out, 0).astype(q.dtype)
    return out, k_pages, v_pages
