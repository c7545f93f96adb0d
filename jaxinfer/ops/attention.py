"""Ragged paged attention: the contract every model call and every implementation shares.

    ragged_paged_attention(q, k, v, k_pages, v_pages, md, *, sm_scale, sliding_window=None,
                           soft_cap=None, sinks=None, k_scale=None, v_scale=None,
                           prologue=None) -> (out [T, Hq, D] in q.dtype, k_pages, v_pages)

Callers use `jaxinfer.ops.attention_registry.ragged_paged_attention`, which picks an
implementation for the call (`AttentionCall`) and runs it; this module holds what they all
share: the layouts, the metadata, the page writes, and the pure-JAX reference
(`ragged_paged_attention_reference`, the spec every implementation is tested against).

A step processes a *ragged batch*: the new tokens of up to S sequences laid end
to end (prefill chunks and single decode tokens mixed). Shapes are static
(padded to buckets); the live part is described by the metadata.

Layouts (shared by every implementation):
  q            [T, Hq, D]    new query tokens, sequence after sequence
  k, v         [T, Hkv, D]   this step's new keys / values (same order)
  (or q = the fused projection [T, (Hq + 2 Hkv) * D], columns q | k | v, with k = v =
  None: an implementation whose registry entry fuses "split_qkv" reads the three from it
  in place, where slices of it would be copies, a kernel each; for the others the
  registry splits it first, `split_qkv`)
  k_pages      [num_pages, page_size, Hkv, D]   one layer's key cache
  v_pages      [num_pages, page_size, Hkv, D]   one layer's value cache
  cu_q_lens    [S + 1] int32  token offsets: sequence s owns q[cu_q_lens[s]:cu_q_lens[s+1]]
  kv_lens      [S] int32      tokens in the cache for s *after* this step
  page_indices [S, P] int32   the pages of sequence s, in order; P * page_size >= kv_lens[s]
  num_seqs     [1] int32      live sequences (<= S); the rest is padding

Token i of sequence s sits at position kv_lens[s] - q_len[s] + i, and attends
causally to cache positions <= its own (so chunked prefill and prefix-cache
hits work). The new k/v are written into the pages (before attending, or by the
kernel itself, which then reads this step's positions from k/v), and the updated
pages are returned (callers donate them so the update is in place).

Any mix of q_len and kv_len is one batch. A speculative-decoding verify step (each
sequence's last accepted token and its k drafts, q_len = k + 1 at decode positions) is
such a batch and needs nothing else: every token sees the drafts before it, and the
drafts a step rejects are dropped by the next step's kv_lens (positions >= kv_len are
never read, and are written again).

Options: `sliding_window` (a token sees the last `sliding_window` positions,
itself included), `soft_cap` (scores -> cap * tanh(scores / cap)), `sinks` [Hq]
(one learned logit per head added to the softmax denominator, gpt-oss), `prologue`
(a `jaxinfer.ops.rope.QKPrologue`: q and k arrive as the projections gave them, and become
attention's q / k by a per-head RMSNorm and RoPE first; the registry applies it with XLA
unless the implementation fuses it).

fp8 KV cache: pages of dtype float8_e4m3fn hold k / k_scale (and v / v_scale),
clipped to the e4m3 range; attention reads them back as page * scale. Scales
are per-layer Python floats (vLLM's per-tensor k_scale / v_scale).

A layer's cache is the pair (k_pages, v_pages): the runner keeps one pair per layer
(`kv_cache[layer]`, sharded over KV heads: `KV_PAGES_AXES`), passes it in and takes the
updated pair back. The page tables (`page_indices`) and the page pool count tokens, not
bytes, so they do not depend on what a token's row holds. A latent-KV implementation
(MLA: one compressed row per token, shared by every head, k and v read from it) plugs in
behind the same entry point: its layer passes the latent pages [num_pages, page_size, 1,
Dc] as k_pages with v_pages = None (and this step's latent rows as k, v = None),
`AttentionCall` gains a field saying which cache layout a call has (default: separate k /
v pages, so the present entries and their callers are unchanged), and a latent entry in
the registry takes the calls with the latent layout. Metadata, `write_kv_pages` and the
page tables are shared as they are.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.sharding import P


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Describes a ragged batch (see the module docstring for shapes).

    zero_tails (static): whether the write zeroes each sequence's last-page tail, so that
    kernels which read whole pages (the Mosaic kernel's TMA loads) see finite values past
    kv_len whatever the pages held, NaN included. The runner passes False: its pools start
    at zero and every write stores finite values (`quantize_kv`), so every page already
    holds finite values, and a masked score's p = 0 times a finite V is 0. (The zeroing
    was two scatters a layer each step: ~1 ms of a 12 ms decode step at 256 sequences.)
    scratch_page (static): the pages' last page is a scratch page that no sequence reads
    (the runner's), where `write_kv_pages` may put a padding token's k/v.
    """

    cu_q_lens: jax.Array
    kv_lens: jax.Array
    page_indices: jax.Array
    num_seqs: jax.Array
    zero_tails: bool = dataclasses.field(default=True, metadata=dict(static=True))
    scratch_page: bool = dataclasses.field(default=False, metadata=dict(static=True))


FP8_KV_DTYPE = jnp.float8_e4m3fn
# Logical axes of a page array (`jaxinfer.sharding`): split over KV heads on a mesh.
KV_PAGES_AXES = P(None, None, "kv_heads", "head_dim")


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """One attention call as the registry's `supports` predicates see it: the static facts
    of its arguments (shapes, dtypes, which options are set), nothing traced.

      num_tokens       T: q's rows, padding included
      num_seqs         S: the metadata's sequence slots (page_indices' rows)
      num_q_heads      Hq
      q_dtype          q's dtype
      page_shape       k_pages' shape (num_pages, page_size, Hkv, D); v_pages alike
      kv_dtype         the pages' dtype: q's, or FP8_KV_DTYPE
      fused_qkv        q is the fused projection [T, (Hq + 2 Hkv) * D], k = v = None
      sliding_window   the window (None: none)
      soft_cap         the cap (None: none)
      sinks            sinks are given
      prologue         a QKPrologue is given (q / k are the raw projections)
    """

    num_tokens: int
    num_seqs: int
    num_q_heads: int
    q_dtype: jnp.dtype
    page_shape: tuple[int, int, int, int]
    kv_dtype: jnp.dtype
    fused_qkv: bool = False
    sliding_window: int | None = None
    soft_cap: float | None = None
    sinks: bool = False
    prologue: bool = False

    @classmethod
    def describe(cls, q, k, k_pages, md: AttentionMetadata, *,
                 sliding_window: int | None = None, soft_cap: float | None = None,
                 sinks=None, prologue=None) -> AttentionCall:
        """The call of `ragged_paged_attention` with these arguments (arrays or shape
        structs; k None: q is the fused projection)."""
        _, _, num_kv_heads, head_dim = k_pages.shape
        fused = k is None
        return cls(
            num_tokens=q.shape[0], num_seqs=md.page_indices.shape[0],
            num_q_heads=(q.shape[1] // head_dim - 2 * num_kv_heads) if fused else q.shape[1],
            q_dtype=jnp.dtype(q.dtype), page_shape=tuple(k_pages.shape),
            kv_dtype=jnp.dtype(k_pages.dtype), fused_qkv=fused, sliding_window=sliding_window,
            soft_cap=soft_cap, sinks=sinks is not None, prologue=prologue is not None)

    @property
    def page_size(self) -> int:
        return self.page_shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.page_shape[2]

    @property
    def head_dim(self) -> int:
        return self.page_shape[3]

    @property
    def query(self) -> jax.ShapeDtypeStruct:
        """The query heads [T, Hq, D] in q's dtype (split out of a fused projection)."""
        return jax.ShapeDtypeStruct((self.num_tokens, self.num_q_heads, self.head_dim),
                                    self.q_dtype)

    @property
    def pages(self) -> jax.ShapeDtypeStruct:
        """k_pages (and v_pages): [num_pages, page_size, Hkv, D] in the pages' dtype."""
        return jax.ShapeDtypeStruct(self.page_shape, self.kv_dtype)


def split_qkv(qkv, num_kv_heads: int, head_dim: int):
    """The fused projection [T, (Hq + 2 Hkv) * D] (columns q | k | v) -> q [T, Hq, D],
    k, v [T, Hkv, D]."""
    heads = qkv.reshape(qkv.shape[0], -1, head_dim)
    hq = heads.shape[1] - 2 * num_kv_heads
    return heads[:, :hq], heads[:, hq:hq + num_kv_heads], heads[:, hq + num_kv_heads:]


def finite_or_zero(x):
    """x with its NaN and +-inf elements replaced by 0 (a comparison and a select, which
    the Pallas GPU kernels lower too)."""
    return jnp.where(jnp.abs(x) <= jnp.finfo(x.dtype).max, x, jnp.zeros((), x.dtype))


def quantize_kv(x, dtype, scale: float | None):
    """What a cache page of `dtype` stores for x: x itself, or x / scale clipped to e4m3;
    non-finite elements as 0, so that pages hold finite values only (`AttentionMetadata.
    zero_tails`): a NaN one sequence's step produced never reaches the sequence that reuses
    its page."""
    if jnp.dtype(dtype) != FP8_KV_DTYPE:
        return finite_or_zero(x.astype(dtype))
    limit = float(jnp.finfo(FP8_KV_DTYPE).max)
    scaled = finite_or_zero(x.astype(jnp.float32)) / (1.0 if scale is None else scale)
    return jnp.clip(scaled, -limit, limit).astype(dtype)


def write_kv_pages(k, v, k_pages, v_pages, md: AttentionMetadata, *,
                   k_scale: float | None = None, v_scale: float | None = None):
    """Scatters this step's k/v [T, Hkv, D] into the pages; padding tokens are dropped (a
    lone one, with md.scratch_page, lands in the scratch page instead).

    The slots past kv_len in each live sequence's last page are zeroed too (unless
    md.zero_tails is False: known finite already), so the pages a kernel reads whole always
    hold finite values.
    """
    page, slot, valid = token_slots(md, k.shape[0], k_pages.shape[1])
    k_new, v_new = quantize_kv(k, k_pages.dtype, k_scale), quantize_kv(v, v_pages.dtype, v_scale)
    if k.shape[0] == 1 and md.scratch_page:
        # One token (batch-1 decode): a dynamic_update_slice, which XLA runs in place with
        # the row computed inside it; a padding token writes the scratch page. (A one-row
        # scatter that must drop an out-of-range row became a kernel that read the old row
        # for a select, then the write: bench/NOTES.md, MoE end to end: One-token KV write as a
        # dynamic_update_slice.)
        page = jnp.where(valid, page, k_pages.shape[0] - 1)[0]
        k_pages = jax.lax.dynamic_update_slice(k_pages, k_new[None], (page, slot[0], 0, 0))
        v_pages = jax.lax.dynamic_update_slice(v_pages, v_new[None], (page, slot[0], 0, 0))
    else:
        # Padding tokens index past the pages (dropped), each its own page, so that every
        # (page, slot) is unique: a scatter told so stores its rows, where XLA's GPU scatter
        # otherwise writes every element with an atomic read-modify-write (a compare-and-swap
        # loop for 16-bit types).
        tokens = jnp.arange(k.shape[0], dtype=page.dtype)
        page = jnp.where(valid, page, k_pages.shape[0] + tokens)
        k_pages = k_pages.at[page, slot].set(k_new, mode="drop", unique_indices=True)
        v_pages = v_pages.at[page, slot].set(v_new, mode="drop", unique_indices=True)
    if not md.zero_tails:
        return k_pages, v_pages
    return zero_page_tails(k_pages, v_pages, md)


def zero_page_tails(k_pages, v_pages, md: AttentionMetadata):
    """Zeroes the slots past kv_len in each live sequence's last page."""
    S, ps = md.kv_lens.shape[0], k_pages.shape[1]
    pos = md.kv_lens[:, None] + jnp.arange(ps)[None, :]  # [S, ps]: kv_len .. + page_size
    end = -(-md.kv_lens // ps) * ps  # the end of kv_len's page
    live = (jnp.arange(S) < md.num_seqs[0])[:, None] & (pos < end[:, None])
    col = jnp.clip(pos // ps, 0, md.page_indices.shape[1] - 1)
    page = jnp.take_along_axis(md.page_indices, col, axis=1)
    page = jnp.where(live, page, k_pages.shape[0])  # out of range: dropped
    zeros = jnp.zeros(page.shape + k_pages.shape[2:], k_pages.dtype)
    k_pages = k_pages.at[page, pos % ps].set(zeros, mode="drop")
    v_pages = v_pages.at[page, pos % ps].set(zeros, mode="drop")
    return k_pages, v_pages


def token_slots(md: AttentionMetadata, num_tokens: int, page_size: int):
    """For each of the T tokens: (the page its k/v go to, the slot in it, is it live);
    a padding token's page and slot are in range but must not be written."""
    seq, pos, valid = token_positions(md, num_tokens)
    return md.page_indices[seq, pos // page_size], pos % page_size, valid


def token_positions(md: AttentionMetadata, num_tokens: int):
    """For each of the T tokens: (its sequence, its position in that sequence, is it live)."""
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    num_seqs = md.num_seqs[0]
    valid = tokens < md.cu_q_lens[num_seqs]
    # Sequence s owns tokens cu_q_lens[s] <= t < cu_q_lens[s + 1]. Compared all at once:
    # the default search is a while loop, whose condition a GPU reads back to the host, so
    # the host could not enqueue the rest of the step ahead of the device.
    seq = jnp.searchsorted(md.cu_q_lens[1:], tokens, side="right", method="compare_all"
                           ).astype(jnp.int32)
    seq = jnp.minimum(seq, md.kv_lens.shape[0] - 1)
    q_len = md.cu_q_lens[seq + 1] - md.cu_q_lens[seq]
    pos = md.kv_lens[seq] - q_len + (tokens - md.cu_q_lens[seq])
    valid = valid & (pos >= 0)
    return seq, jnp.where(valid, pos, 0), valid


def ragged_paged_attention_reference(
    q, k, v, k_pages, v_pages, md: AttentionMetadata, *,
    sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
    sinks: jax.Array | None = None, k_scale: float | None = None, v_scale: float | None = None,
):
    """Pure-JAX reference (the spec). Returns (out [T, Hq, D] in q.dtype, k_pages, v_pages).

    It gathers every sequence's pages and attends densely with a mask, which
    costs T x S x P x page_size scores: fine as a spec, not for serving (the CPU runs
    `attention_by_sequence`, whose work follows the live tokens).
    fp8 pages are upcast exactly to q.dtype; their scales multiply the scores and
    the output (as the kernels do).
    """
    k_pages, v_pages = write_kv_pages(k, v, k_pages, v_pages, md, k_scale=k_scale,
                                      v_scale=v_scale)
    T, Hq, D = q.shape
    S, P = md.page_indices.shape
    page_size, Hkv = k_pages.shape[1], k_pages.shape[2]
    G = Hq // Hkv
    ctx = P * page_size

    # All cached keys of all sequences: [S, ctx, Hkv, D].
    k_all = k_pages[md.page_indices].reshape(S, ctx, Hkv, D)
    v_all = v_pages[md.page_indices].reshape(S, ctx, Hkv, D)
    fp8 = k_pages.dtype == FP8_KV_DTYPE
    if fp8:
        k_all, v_all = k_all.astype(q.dtype), v_all.astype(q.dtype)
        sm_scale = sm_scale * (1.0 if k_scale is None else k_scale)

    token_seq, q_pos, valid = token_positions(md, T)
    kv_pos = jnp.arange(ctx, dtype=jnp.int32)
    # Zero the slots past each live sequence's length: pages may hold anything there
    # (NaN included), and a masked probability of 0 times NaN would still be NaN.
    live_kv = (kv_pos[None, :] < md.kv_lens[:, None]) & (jnp.arange(S) < md.num_seqs[0])[:, None]
    k_all = jnp.where(live_kv[:, :, None, None], k_all, 0)
    v_all = jnp.where(live_kv[:, :, None, None], v_all, 0)
    mask = (token_seq[:, None] == jnp.arange(S)[None, :])[:, :, None]  # [T, S, 1]
    mask &= kv_pos[None, None, :] <= q_pos[:, None, None]
    mask &= kv_pos[None, None, :] < md.kv_lens[None, :, None]
    if sliding_window is not None:
        mask &= q_pos[:, None, None] - kv_pos[None, None, :] < sliding_window
    mask &= valid[:, None, None]

    qg = q.reshape(T, Hkv, G, D)
    scores = jnp.einsum(
        "thgd,sjhd->thgsj", qg, k_all, preferred_element_type=jnp.float32
    ) * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    scores = scores.reshape(T, Hkv, G, S * ctx)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(1, Hkv, G, 1)
        row_max = jnp.maximum(row_max, sink)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # fully masked (padding) rows
    p = jnp.exp(scores - row_max)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        denom += jnp.exp(sink - row_max)
    p = p / jnp.where(denom == 0, 1.0, denom)
    out = jnp.einsum(
        "thgj,jhd->thgd", p.astype(v_all.dtype), v_all.reshape(S * ctx, Hkv, D),
        preferred_element_type=jnp.float32,
    )
    if fp8 and v_scale is not None:
        out = out * v_scale
    return out.reshape(T, Hq, D).astype(q.dtype), k_pages, v_pages
