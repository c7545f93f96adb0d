"""Ragged paged attention: Pallas kernel, GPU (Triton) lowering, one program per token.

Same contract as `jaxinfer.ops.attention.ragged_paged_attention_reference` (the spec;
layouts in that module's docstring): q [T, Hq, D], k / v [T, Hkv, D], pages
[num_pages, page_size, Hkv, D] in q.dtype or float8_e4m3fn, AttentionMetadata ->
(out [T, Hq, D] in q.dtype, k_pages, v_pages).

Algorithm (flash decoding over pages):
  1. The kernel writes the new k/v into the pages itself (the pages are aliased to its
     outputs, in place under donation): program (t, h, 0) stores token t's row of KV
     head h after its attention. The programs run at once, so none reads a row this
     step writes: positions from the first new token of a sequence on come from the
     k/v inputs instead (row t + j - pos for position j of token t at position pos).
     (This assumes a sequence's pages are its own below kv_len, as the engine's are;
     only the runner's warm-up steps repeat the scratch page, and discard the output.)
     As XLA ops the write took two kernels per layer at batch-1 decode; the slots past
     kv_len in a last page are still zeroed by XLA after the kernel where md.zero_tails
     (not in the runner's steps, whose pages hold finite values only).
  2. Grid = (T, Hkv, splits): program (t, h, s) attends token t's G = Hq / Hkv query
     heads of KV head h over split s of the page table's blocks of `block_kv` cache
     positions (a fixed share, so no loaded scalar delays its first loads; with a
     sliding window, a share of the blocks the window covers), masked to the token's
     causal range. The G heads are
     the rows of a [GP, D] x [D, block_kv] product (GP = G rounded up to a power of two
     >= 16, the smallest dot Triton takes; the extra rows repeat head G - 1).
  3. Each block gathers its rows straight from the pages (or, for this step's
     positions, from k/v): position j of the sequence lives at row page_indices[seq,
     j // page_size] * page_size + j % page_size of the pages viewed as [num_pages *
     page_size, Hkv, D]. Positions outside the token's range are masked in the scores
     and zeroed in V (pages may hold NaN there, and so may a masked load, which the
     writing form uses: 0 * NaN = NaN in the PV product).
  4. Online softmax in base 2, float32. A sink is a virtual key with logit sinks[h]
     and value 0: split 0 starts its running max / denominator from it.
  5. At one token (batch-1 decode) with pages in q's dtype, the kernel takes q, k and v
     as the projection gave them: the fused projection's output read in place (its heads
     q | k | v), and a `QKPrologue` (per-head norm, RoPE) applied to its G query heads and
     the token's k row. As XLA ops the prologue took three small kernels a layer, and
     slicing q, k, v out of the projection two more. The one new row of each block is then
     the program's own k / v row (a select, not a second masked gather). Otherwise XLA
     splits the projection and applies the prologue first.
  6. One split: the program writes q.dtype rows straight into out [T, Hq, D]. Several:
     each writes float32 rows normalised over its keys and their log-sum-exp (base
     2), and a second kernel merges them, a program per query head. Padding tokens
     see no keys and come out 0.

Every token reads its own keys, so a prefill chunk of n tokens reads its pages n
times: this kernel is for steps of few tokens (decode), where a program per
(token, KV head, split) fills the GPU; the Mosaic GPU kernel takes the rest on Hopper
(`jaxinfer.ops.attention_registry` picks). fp8 pages are upcast to q.dtype in registers; k_scale
folds into the score scale and v_scale multiplies the output.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jaxinfer.ops.attention import (
    FP8_KV_DTYPE,
    AttentionMetadata,
    finite_or_zero,
    quantize_kv,
    token_positions,
    zero_page_tails,
)
from jaxinfer.ops.rope import QKPrologue, inverse_rms, scale_normed

MASKED = -1e30  # masked score (base-2 units): exp2(MASKED - m) == 0 for any real m
LOG2E = math.log2(math.e)
NUM_SMS = 132  # H100 / H200 SXM: the splits aim for about two programs per SM
MIN_DOT = 16  # Triton's smallest dot dimension


def _attention_kernel(token_seq_ref, token_pos_ref, new_start_ref, page_indices_ref, q_ref,
                      k_ref, v_ref, *rest, group: int, rows: int, page_size: int,
                      block_kv: int, num_splits: int, scale: float,
                      sliding_window: int | None, soft_cap: float | None, use_sinks: bool,
                      v_scale: float | None, write: bool, kv_head0: tuple[int, int],
                      prologue: dict | None):
    """One (token, KV head, split). new_start_ref [T]: the position of the first of this
    step's tokens of token t's sequence; q_ref [T, H, D] (query heads first: KV head h's
    are h * G + g); k_ref / v_ref [num_pages * page_size, Hkv, D]; if write: k_new_ref /
    v_new_ref [T, H', D] in the pages' dtype, KV head h at head kv_head0[0] + h (k) /
    kv_head0[1] + h (v): separate arrays (kv_head0 = (0, 0)), or q_ref's array again (the
    fused projection); sinks_ref [Hkv, G] (base-2 logits) if use_sinks; if prologue (T = 1,
    `prologue_rows`): cos_ref / sin_ref [T, D], then q_norm_ref / k_norm_ref [D] if it has
    norms, and q / k_new are the raw projections. Outputs: out_ref [T, Hq, D]
    (one split) or [T, Hkv, SP, rows, D] float32 with lse_ref [T, Hkv, SP, rows] (SP:
    splits rounded up to a power of two); then, if write, k_out_ref / v_out_ref, the
    pages (aliased to k_ref / v_ref)."""
    k_new_ref = v_new_ref = sinks_ref = None
    if write:
        k_new_ref, v_new_ref, *rest = rest
    if use_sinks:
        sinks_ref, *rest = rest
    if prologue is not None:
        cos_ref, sin_ref, *rest = rest
        norm_refs = (None, None)
        if prologue["norm"]:
            *norm_refs, = rest[:2]
            rest = rest[2:]
    out_ref, lse_ref = (rest[0], None) if num_splits == 1 else rest[:2]
    k_out_ref, v_out_ref = rest[-2:] if write else (None, None)  # the pages, aliased
    t, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_seqs, num_pages_per_seq = page_indices_ref.shape
    # One sequence slot (batch-1 decode): no load stands before the page ids.
    seq = 0 if num_seqs == 1 else token_seq_ref[t]
    pos = token_pos_ref[t]  # -1: padding, sees nothing
    head = jnp.minimum(lax.iota(jnp.int32, rows), group - 1)  # rows past G repeat G - 1
    one_token = q_ref.shape[0] == 1  # (static) each new row is a token's own

    if write:
        # Program (t, h, 0) stores the token's row (padding tokens store nothing) at the
        # end; its loads go first, so that they wait on no other load.
        col = jnp.clip(pos // page_size, 0, num_pages_per_seq - 1)
        slot = page_indices_ref[seq, col] * page_size + jnp.maximum(pos, 0) % page_size
        k_head, v_head = kv_head0[0] + h, kv_head0[1] + h
        k_row, v_row = k_new_ref[t, k_head, :], v_new_ref[t, v_head, :]
        if not one_token:  # positions >= this are read from k_new / v_new
            new_start = new_start_ref[t]
        if prologue is not None:  # (T = 1) the k row normed and rotated, as q below
            k_swap = pl_triton.load(k_new_ref.at[t, k_head, swapped_d(k_row)])
            k_row = prologue_rows(k_row, k_swap, norm_refs[1], cos_ref, sin_ref, t, prologue)
        if kv_head0 != (0, 0):  # the raw projection: stored finite, as `quantize_kv` does
            k_row = finite_or_zero(k_row.astype(k_out_ref.dtype))
            v_row = finite_or_zero(v_row.astype(v_out_ref.dtype))

    end = pos + 1  # the token sees positions [start, end)
    start = 0 if sliding_window is None else jnp.maximum(end - sliding_window, 0)
    if sliding_window is None:
        # Split s takes a fixed share of the page table's blocks, not of the token's
        # range, so its first loads (page ids, then K / V) wait on no loaded scalar;
        # positions out of [start, end) are masked. (The engine sizes page_indices to a
        # power of two of pages >= the longest sequence: at most about half is spare.)
        blocks = pl.cdiv(num_pages_per_seq * page_size, block_kv)
        lo = s * pl.cdiv(blocks, num_splits)
        hi = jnp.minimum(lo + pl.cdiv(blocks, num_splits), blocks)
    else:
        # A window: the splits share the blocks it covers (a share of the whole table
        # could read far more than the window holds).
        first = start // block_kv
        blocks = jnp.maximum(pl.cdiv(end, block_kv) - first, 0)
        lo = first + s * pl.cdiv(blocks, num_splits)
        hi = jnp.minimum(lo + pl.cdiv(blocks, num_splits), first + blocks)

    q_head = h * group + head
    q = q_ref[t, q_head, :]  # [rows, D]
    if prologue is not None:
        q_swap = pl_triton.load(q_ref.at[t, q_head[:, None], swapped_d(q)[None, :]])
        q = prologue_rows(q, q_swap, norm_refs[0], cos_ref, sin_ref, t, prologue)
    if use_sinks:
        sink = sinks_ref[h, head]
        max0 = jnp.where(s == 0, sink, MASKED)
        denom0 = jnp.where(s == 0, jnp.ones((rows,), jnp.float32), 0.0)
    else:
        max0 = jnp.full((rows,), MASKED, jnp.float32)
        denom0 = jnp.zeros((rows,), jnp.float32)
    acc0 = jnp.zeros(q.shape, jnp.float32)

    def body(b, carry):
        row_max, denom, acc = carry
        j = b * block_kv + lax.iota(jnp.int32, block_kv)  # cache positions
        col = jnp.minimum(j // page_size, num_pages_per_seq - 1)
        page = jnp.clip(page_indices_ref[seq, col], 0, k_ref.shape[0] // page_size - 1)
        row = page * page_size + j % page_size
        live = (j >= start) & (j < end)
        if write and one_token:  # the one new row (j = pos) is the program's own
            new = live & (j == pos)
            k = _select_row(k_ref, row, h, live & ~new, k_row, new, q.dtype)
            v = _select_row(v_ref, row, h, live & ~new, v_row, new, q.dtype)
        elif write:  # this step's rows come from k_new / v_new (token t + j - pos)
            new = live & (j >= new_start)
            new_row = jnp.clip(t + j - pos, 0, k_new_ref.shape[0] - 1)
            k = _gather_rows(k_ref, row, h, live & ~new, k_new_ref, new_row, k_head, new,
                             q.dtype)
            v = _gather_rows(v_ref, row, h, live & ~new, v_new_ref, new_row, v_head, new,
                             q.dtype)
        else:
            k, v = k_ref[row, h, :].astype(q.dtype), v_ref[row, h, :].astype(q.dtype)
        # V zeroed out of range: pages may hold NaN there, and 0 * NaN = NaN.
        v = jnp.where(live[:, None], v, jnp.zeros_like(v))  # [block_kv, D]
        scores = pl_triton.dot(q, k, trans_b=True).astype(jnp.float32)
        if soft_cap is not None:  # cap * tanh(x / cap) in natural units, then base 2
            scores = soft_cap * LOG2E * jnp.tanh(scores * (scale / soft_cap))
        else:
            scores = scores * (scale * LOG2E)
        scores = jnp.where(live[None, :], scores, MASKED)
        new_max = jnp.maximum(row_max, jnp.max(scores, axis=1))
        # (Masked scores get p = 0 even while the max is still MASKED, as in a block
        # wholly outside the token's range.)
        p = jnp.where(live[None, :], jnp.exp2(scores - new_max[:, None]), 0.0)
        alpha = jnp.exp2(row_max - new_max)
        pv = pl_triton.dot(p.astype(v.dtype), v).astype(jnp.float32)
        return new_max, denom * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

    row_max, denom, acc = lax.fori_loop(lo, hi, body, (max0, denom0, acc0))
    out = acc / jnp.where(denom == 0.0, 1.0, denom)[:, None]
    if v_scale is not None:
        out = out * v_scale
    if num_splits == 1:
        # Rows past G repeat head G - 1, so their duplicate writes store the same values.
        out_ref[t, h * group + head, :] = out.astype(out_ref.dtype)
    else:
        out_ref[t, h, s, :, :] = out
        lse_ref[t, h, s, :] = jnp.where(denom == 0.0, -jnp.inf, row_max + jnp.log2(denom))
    if write:
        keep = jnp.full(k_row.shape, (s == 0) & (pos >= 0))
        pl_triton.store(k_out_ref.at[slot, h, :], k_row, mask=keep)
        pl_triton.store(v_out_ref.at[slot, h, :], v_row, mask=keep)


def swapped_d(x):
    """[D] int32: (d + D / 2) % D, the halves of a head swapped (RoPE's rotate_half)."""
    half = x.shape[-1] // 2
    return (lax.iota(jnp.int32, x.shape[-1]) + half) % x.shape[-1]


def prologue_rows(x, x_swap, norm_ref, cos_ref, sin_ref, t, prologue: dict):
    """`QKPrologue.apply` on rows x [..., D] of token t (x_swap: the same rows with their
    halves swapped), rounding to x.dtype where XLA's ops do: RMSNorm (if norm_ref; the
    contract's `inverse_rms` / `scale_normed`), then RoPE by token t's rows of the tables
    cos_ref / sin_ref [T, D]. The RoPE step is `jaxinfer.ops.rope.apply_rope` in the form
    Triton lowers (float32 arithmetic rounded to x.dtype after each of XLA's ops, the
    rotated half loaded from memory rather than reversed in registers); the prologue tests
    hold both to the same float64 oracle."""
    dtype, f32 = x.dtype, jnp.float32
    x32, s32 = x.astype(f32), x_swap.astype(f32)
    if norm_ref is not None:
        inv = inverse_rms(x32, prologue["eps"])
        d = lax.iota(jnp.int32, x.shape[-1])
        scale, scale_swap = norm_ref[d].astype(f32), norm_ref[swapped_d(x)].astype(f32)
        # float32 scales: the product in float32, rounded to dtype as XLA's dtype product.
        x32 = scale_normed(x32, inv, scale, dtype).astype(dtype).astype(f32)
        s32 = scale_normed(s32, inv, scale_swap, dtype).astype(dtype).astype(f32)
    cos, sin = cos_ref[t, :].astype(f32), sin_ref[t, :].astype(f32)
    half = x.shape[-1] // 2
    sign = jnp.where(lax.iota(jnp.int32, x.shape[-1]) < half, -1.0, 1.0)  # [-x2, x1]
    rotated = (sign * s32 * sin).astype(dtype).astype(f32)
    return ((x32 * cos).astype(dtype).astype(f32) + rotated).astype(dtype)


def _select_row(pages_ref, row, h, from_pages, new, is_new, dtype):
    """[block_kv, D] of KV head h in dtype: pages_ref[row] where from_pages, the row `new`
    [D] where is_new, unspecified elsewhere (a masked load: a row not taken is not read)."""
    d = lax.iota(jnp.int32, pages_ref.shape[-1])[None, :]
    old = pl_triton.load(pages_ref.at[row[:, None], h, d], mask=from_pages[:, None] & (d >= 0))
    return jnp.where(is_new[:, None], new.astype(dtype)[None, :], old.astype(dtype))


def _gather_rows(pages_ref, row, h, from_pages, new_ref, new_row, new_head, from_new, dtype):
    """[block_kv, D] of KV head h in dtype: pages_ref[row] where from_pages, new_ref[new_row,
    new_head] where from_new, unspecified elsewhere (masked loads: a row not taken is not
    read)."""
    # Every index an array (no slice): interpret mode's masked gather wants that. The
    # masks' `& (d >= 0)` (always true) broadcasts them from [block_kv, 1] to [block_kv, D].
    d = lax.iota(jnp.int32, pages_ref.shape[-1])[None, :]
    old = pl_triton.load(pages_ref.at[row[:, None], h, d], mask=from_pages[:, None] & (d >= 0))
    new = pl_triton.load(new_ref.at[new_row[:, None], new_head, d],
                         mask=from_new[:, None] & (d >= 0))
    return jnp.where(from_new[:, None], new.astype(dtype), old.astype(dtype))


def choose_splits(num_tokens: int, num_kv_heads: int, max_ctx: int, block_kv: int,
                  sliding_window: int | None = None) -> int:
    """KV splits per (token, KV head): about two programs per SM, one block at least each
    (of the blocks a token can see: max_ctx, or its window's)."""
    target = -(-2 * NUM_SMS // (num_tokens * num_kv_heads))
    if sliding_window is not None:
        max_ctx = min(max_ctx, sliding_window + block_kv - 1)
    return max(1, min(target, -(-max_ctx // block_kv)))


def _merge_splits_kernel(out_ref, lse_ref, merged_ref, *, group: int, num_splits: int):
    """One query head g of token t, KV head h: its splits' rows merged. out_ref [T, Hkv,
    SP, rows, D] float32 (normalised per split; SP = splits rounded up to a power of two,
    the slots past num_splits unwritten), lse_ref [T, Hkv, SP, rows] (base 2; -inf where a
    split saw nothing; the sinks already joined split 0's sums) -> merged_ref [T, Hq, D].
    All splits load at once: a loop over them waited on a load per split."""
    t, h, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    split = lax.iota(jnp.int32, lse_ref.shape[2])
    written = split < num_splits
    lse = pl_triton.load(lse_ref.at[t, h, split, g], mask=written, other=-jnp.inf)  # [SP]
    d = lax.iota(jnp.int32, out_ref.shape[-1])[None, :]  # (d >= 0: a mask of [SP, D])
    out = pl_triton.load(out_ref.at[t, h, split[:, None], g, d],
                         mask=written[:, None] & (d >= 0), other=0.0)  # [SP, D]
    top = jnp.max(lse)
    top = jnp.where(top == -jnp.inf, 0.0, top)  # no split saw a key (padding): all 0
    w = jnp.exp2(lse - top)
    denom = jnp.sum(w)
    merged = jnp.sum(w[:, None] * out, axis=0) / jnp.where(denom == 0.0, 1.0, denom)
    merged_ref[t, h * group + g, :] = merged.astype(merged_ref.dtype)


def ragged_paged_attention_gpu(
    q, k, v, k_pages, v_pages, md: AttentionMetadata, *,
    sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
    sinks: jax.Array | None = None, k_scale: float | None = None, v_scale: float | None = None,
    prologue: QKPrologue | None = None, block_kv: int | None = None,
    num_splits: int | None = None,
):
    """Writes k/v into the pages and attends, in the Pallas GPU kernel (module doc).
    `block_kv` / `num_splits` override the defaults (benchmarks, tests). A fused projection
    (k = v = None) is read in place and a prologue applied in the kernel, which it can do
    only where `fuses_prologue` says (the registry asks it); elsewhere ValueError."""
    if (k is None or prologue is not None) and not fuses_prologue(q, k_pages):
        raise ValueError("ragged_paged_attention_gpu: a fused projection or a prologue needs "
                         "one token and pages in q's dtype (fuses_prologue)")
    if k is None:  # the fused projection: q's array holds the new k and v heads too
        new_kv, kv_in_q = None, True
    else:
        new_kv = (quantize_kv(k, k_pages.dtype, k_scale),
                  quantize_kv(v, v_pages.dtype, v_scale))
        kv_in_q = False
    out, k_pages, v_pages = attend_pages_gpu(
        q, k_pages, v_pages, md, new_kv=new_kv, kv_in_q=kv_in_q, sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks, k_scale=k_scale,
        v_scale=v_scale, prologue=prologue, block_kv=block_kv, num_splits=num_splits)
    if md.zero_tails:
        k_pages, v_pages = zero_page_tails(k_pages, v_pages, md)
    return out, k_pages, v_pages


# Jitted so that a model's layers share one trace and one lowering of the kernel.
@functools.partial(jax.jit, static_argnames=("kv_in_q", "sm_scale", "sliding_window",
                                             "soft_cap", "k_scale", "v_scale", "block_kv",
                                             "num_splits"))
def attend_pages_gpu(
    q, k_pages, v_pages, md: AttentionMetadata, *, new_kv=None, kv_in_q: bool = False,
    sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
    sinks: jax.Array | None = None, k_scale: float | None = None, v_scale: float | None = None,
    prologue: QKPrologue | None = None, block_kv: int | None = None,
    num_splits: int | None = None,
):
    """The kernel: -> (out [T, Hq, D], k_pages, v_pages). new_kv: this step's (k, v) [T, Hkv,
    D] in the pages' dtype, which the kernel writes into the pages; None: the pages hold
    them already (benchmarks of the attention alone), and are returned as they are.
    kv_in_q: q is the fused projection [T, (Hq + 2 Hkv) * D] (heads q | k | v), whose k and
    v heads the kernel writes, in the pages' dtype. prologue: q and the new k are raw
    projections, normed and rotated in the kernel (one token, pages in q's dtype)."""
    num_pages, page_size, Hkv, D = k_pages.shape
    T = q.shape[0]
    heads = q.reshape(T, -1, D)  # [T, H, D]: the query heads first
    Hq = heads.shape[1] - (2 * Hkv if kv_in_q else 0)
    query = jax.ShapeDtypeStruct((T, Hq, D), q.dtype)
    if (reason := unsupported_reason(query, k_pages)) is not None:
        raise ValueError(f"pallas gpu attention: {reason}")
    write = new_kv is not None or kv_in_q
    if prologue is not None and (T != 1 or not write or k_pages.dtype != q.dtype):
        raise ValueError("pallas gpu attention: the prologue runs in the kernel only at one "
                         "token, writing its k / v, on pages in q's dtype")
    P = md.page_indices.shape[1]
    G = Hq // Hkv
    rows = max(MIN_DOT, pl.next_power_of_2(G))
    fp8 = k_pages.dtype == FP8_KV_DTYPE
    block_kv = block_kv or max(MIN_DOT, min(64, pl.next_power_of_2(page_size * P)))
    if block_kv < MIN_DOT or block_kv & (block_kv - 1):
        raise ValueError(f"pallas gpu attention: block_kv {block_kv}: a power of two >= "
                         f"{MIN_DOT} required")
    splits = num_splits or choose_splits(T, Hkv, P * page_size, block_kv, sliding_window)

    token_seq, token_pos, valid = token_positions(md, T)
    token_pos = jnp.where(valid, token_pos, -1)
    # The position of the first of this step's tokens of each token's sequence.
    new_start = token_pos - (jnp.arange(T, dtype=jnp.int32) - md.cu_q_lens[token_seq])
    scale = sm_scale * (k_scale if (fp8 and k_scale is not None) else 1.0)
    pages_shape = (num_pages * page_size, Hkv, D)
    args = [token_seq, token_pos, new_start, md.page_indices, heads,
            k_pages.reshape(pages_shape), v_pages.reshape(pages_shape)]
    if kv_in_q:  # k and v heads read from q's array, after its query heads
        args += [heads, heads]
    elif new_kv is not None:
        args += list(new_kv)
    if sinks is not None:
        args.append((sinks.astype(jnp.float32) * LOG2E).reshape(Hkv, G))
    if prologue is not None:
        args += [prologue.cos, prologue.sin]
        if prologue.q_norm is not None:
            args += [prologue.q_norm, prologue.k_norm]
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct((T, Hq, D), q.dtype)]
    else:
        sp = pl.next_power_of_2(splits)  # the merge loads them as one block
        out_shape = [jax.ShapeDtypeStruct((T, Hkv, sp, rows, D), jnp.float32),
                     jax.ShapeDtypeStruct((T, Hkv, sp, rows), jnp.float32)]
    aliases = {}
    if write:  # the pages, written in place
        aliases = {5: len(out_shape), 6: len(out_shape) + 1}
        out_shape += [jax.ShapeDtypeStruct(pages_shape, k_pages.dtype)] * 2
    kernel = functools.partial(
        _attention_kernel, group=G, rows=rows, page_size=page_size, block_kv=block_kv,
        num_splits=splits, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
        use_sinks=sinks is not None, v_scale=v_scale if fp8 else None,
        write=write, kv_head0=(Hq, Hq + Hkv) if kv_in_q else (0, 0),
        prologue=None if prologue is None else dict(
            norm=prologue.q_norm is not None, eps=prologue.eps))
    results = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(T, Hkv, splits), input_output_aliases=aliases,
        compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),
        interpret=jax.default_backend() != "gpu",
    )(*args)
    if write:
        k_pages, v_pages = (x.reshape(k_pages.shape) for x in results[-2:])
    if splits == 1:
        return results[0], k_pages, v_pages
    # The splits merged by a second kernel, a program per query head (as XLA ops the
    # merge took two kernels: bench/NOTES.md, Ragged paged attention: Split merge as a second
    # Pallas kernel).
    out = pl.pallas_call(
        functools.partial(_merge_splits_kernel, group=G, num_splits=splits),
        out_shape=jax.ShapeDtypeStruct((T, Hq, D), q.dtype), grid=(T, Hkv, G),
        compiler_params=pl_triton.CompilerParams(num_warps=1, num_stages=2),
        interpret=jax.default_backend() != "gpu",
    )(*results[:2])
    return out, k_pages, v_pages


def fuses_prologue(q, k_pages) -> bool:
    """Whether the kernel can read a fused q/k/v projection in place and apply a
    `QKPrologue` itself for q ([T, ...], the heads or the fused projection) and these
    pages: at one token with pages in q's dtype, the form it is built for; other calls
    get q, k and v split and the prologue applied before (the registry decides)."""
    return q.shape[0] == 1 and k_pages.dtype == q.dtype


def unsupported_reason(q, k_pages) -> str | None:
    """Why this kernel cannot take these inputs (None if it can)."""
    _, Hq, D = q.shape
    Hkv = k_pages.shape[2]
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"q dtype {q.dtype}: needs bfloat16 or float16"
    if k_pages.dtype not in (q.dtype, FP8_KV_DTYPE):
        return f"KV pages {k_pages.dtype} with q {q.dtype}"
    if D < MIN_DOT or D & (D - 1) or Hq % Hkv:
        return (f"head_dim {D} (a power of two >= {MIN_DOT}) and query heads {Hq} (a multiple "
                f"of the {Hkv} KV heads) required")
    return None
