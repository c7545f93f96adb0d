"""Ragged paged attention in XLA, one live sequence at a time: the implementation that runs
where no kernel does (the CPU; float32 models, GPUs before Hopper).

The reference (`ragged_paged_attention_reference`, the spec) attends densely: every token
against every sequence slot's whole page table, T x S x P * page_size scores a layer. A
prefill step of 2048 tokens with 64 sequence slots and a 2048-token table is 2.4e9 scores
(9.7 GB of float32 at SmolLM2's 9 heads), and a 64-sequence decode step computes 64 times
the scores it keeps. This one costs what the batch holds:

  for each live sequence s (a while loop to num_seqs: padding slots cost nothing)
    for each block of `rows` of its query rows (the last block may reach past s: the rows
    of other sequences are computed and dropped)
      for each block of KV_BLOCK_TOKENS cache positions those rows can see (from the
      sliding window's first to the last row's own position)
        gather the block's pages, score, online softmax (float32)

`rows` is static: 1 in a program with as many sequence slots as tokens (a decode batch, or
short prompts), else ROW_BLOCK, where a prompt's rows share each KV block they read and a
decode token beside them costs ROW_BLOCK rows. One row block size keeps the program to one
loop nest a layer: each further nest (a size per sequence) cost XLA:CPU about 2 s more
compile per program of SmolLM2's 30 layers.

Work: about (live tokens) x (the context each sees). Same signature, layouts and results as
the reference (the module docstring of `jaxinfer.ops.attention`); padding rows are 0, as
there.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxinfer.ops.attention import FP8_KV_DTYPE, AttentionMetadata, write_kv_pages

# Query rows per block in programs with fewer sequence slots than tokens.
ROW_BLOCK = 16
# Cache positions per KV block (a whole number of pages, dividing the page table's width).
KV_BLOCK_TOKENS = 256


def ragged_paged_attention_by_sequence(
    q, k, v, k_pages, v_pages, md: AttentionMetadata, *,
    sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
    sinks: jax.Array | None = None, k_scale: float | None = None, v_scale: float | None = None,
    fixed_rows: bool = False,
):
    """The contract's call (`jaxinfer.ops.attention`) -> (out [T, Hq, D] in q.dtype, k_pages,
    v_pages), attending sequence by sequence (see the module docstring). fixed_rows: every
    row block has ROW_BLOCK rows whatever the program (q padded to at least that many), so
    a token's products have one shape in every batch (batch-invariant mode)."""
    k_pages, v_pages = write_kv_pages(k, v, k_pages, v_pages, md, k_scale=k_scale,
                                      v_scale=v_scale)
    num_tokens = q.shape[0]
    if fixed_rows and num_tokens < ROW_BLOCK:  # padding rows: computed and dropped
        q = jnp.pad(q, ((0, ROW_BLOCK - num_tokens), (0, 0), (0, 0)))
    T, Hq, D = q.shape
    S, P = md.page_indices.shape
    page_size, Hkv = k_pages.shape[1], k_pages.shape[2]
    G = Hq // Hkv
    block_pages = math.gcd(P, max(1, KV_BLOCK_TOKENS // page_size))
    block_kv = block_pages * page_size
    fp8 = k_pages.dtype == FP8_KV_DTYPE
    compute_dtype = q.dtype if fp8 else k_pages.dtype
    score_scale = sm_scale * (k_scale if fp8 and k_scale is not None else 1.0)
    out_scale = v_scale if fp8 and v_scale is not None else 1.0
    rows = ROW_BLOCK if fixed_rows else 1 if T <= S else min(ROW_BLOCK, T)

    def attend_rows(seq, row0, first_pos):
        """The rows row0 .. row0 + rows - 1 against sequence seq's cache (its row row0 at
        cache position first_pos) -> [rows, Hq, D] float32 (rows of other sequences:
        garbage)."""
        kv_len = md.kv_lens[seq]
        qb = jax.lax.dynamic_slice(q, (row0, 0, 0), (rows, Hq, D)).reshape(rows, Hkv, G, D)
        pos = first_pos + jnp.arange(rows, dtype=jnp.int32)
        end = jnp.minimum(first_pos + rows, kv_len)  # positions < end are visible to some row
        begin = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
        table = md.page_indices[seq]

        def kv_block(j, carry):
            m, denom, acc = carry
            pages = jax.lax.dynamic_slice(table, (j * block_pages,), (block_pages,))
            kv_pos = j * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
            live = kv_pos < kv_len
            # Slots past kv_len may hold anything (NaN too): zero them, as 0 x NaN is NaN.
            kb, vb = (jnp.where(live[:, None, None],
                                pool[pages].reshape(block_kv, Hkv, D).astype(compute_dtype), 0)
                      for pool in (k_pages, v_pages))
            s = jnp.einsum("rhgd,khd->rhgk", qb, kb,
                           preferred_element_type=jnp.float32) * score_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            mask = live[None, :] & (kv_pos[None, :] <= pos[:, None])
            if sliding_window is not None:
                mask &= pos[:, None] - kv_pos[None, :] < sliding_window
            s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            pv = jnp.einsum("rhgk,khd->rhgd", p.astype(vb.dtype), vb,
                            preferred_element_type=jnp.float32)
            return m_new, denom * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv

        if sinks is None:
            m0, denom0 = jnp.full((rows, Hkv, G), -jnp.inf), jnp.zeros((rows, Hkv, G))
        else:  # a sink is one more logit in the denominator, with no value
            m0 = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(Hkv, G), (rows, Hkv, G))
            denom0 = jnp.ones((rows, Hkv, G))
        _, denom, acc = jax.lax.fori_loop(begin // block_kv, -(-end // block_kv), kv_block,
                                          (m0, denom0, jnp.zeros((rows, Hkv, G, D))))
        return (acc / jnp.where(denom == 0, 1.0, denom)[..., None]).reshape(rows, Hq, D)

    def sequence(seq, out):
        start, end = md.cu_q_lens[seq], md.cu_q_lens[seq + 1]
        first = md.kv_lens[seq] - (end - start)  # the cache position of row start

        def block(i, out):
            row0 = jnp.minimum(start + i * rows, T - rows)
            o = (attend_rows(seq, row0, first + row0 - start) * out_scale).astype(q.dtype)
            r = row0 + jnp.arange(rows)
            mine = ((r >= start) & (r < end))[:, None, None]
            old = jax.lax.dynamic_slice(out, (row0, 0, 0), (rows, Hq, D))
            return jax.lax.dynamic_update_slice(out, jnp.where(mine, o, old), (row0, 0, 0))
        return jax.lax.fori_loop(0, -(-(end - start) // rows), block, out)

    out = jax.lax.fori_loop(0, md.num_seqs[0], sequence, jnp.zeros((T, Hq, D), q.dtype))
    return out[:num_tokens], k_pages, v_pages
