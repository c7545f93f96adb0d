"""Ragged paged attention for Hopper, as a Mosaic GPU kernel (`plgpu.kernel`).

Same contract as `jaxinfer.ops.attention.ragged_paged_attention_reference` (the
spec): q [T, Hq, D], this step's k/v [T, Hkv, D], pages [num_pages, page_size,
Hkv, D], metadata (cu_q_lens [S+1], kv_lens [S], page_indices [S, P],
num_seqs [1]); returns (out [T, Hq, D] in q.dtype, k_pages, v_pages).

Algorithm (flash attention over pages):
- The new k/v are scattered into the pages by XLA first (`write_kv_pages`, in
  place under donation). The kernel reads whole pages, so every page it reads
  must hold finite values (a masked P = 0 times a stale NaN would still be NaN):
  the write zeroes the slots past kv_len of each sequence's last page, unless
  md.zero_tails says the pages are finite already (the runner's).
- Work list (built with jnp, static length): one entry per (sequence, block of
  `tokens_per_block` tokens). Queries are scattered into per-entry tiles
  [Hkv, entries, compute_wgs * 64, D]: the G = Hq / Hkv query heads of a KV
  head fill the wgmma M dimension (64 rows = 64 // G tokens x G heads). Only
  live rows are written; the others hold whatever the buffer held, which stays
  in their own rows of S, P and O. Decode steps (`Config.queries_in_place`: one
  token an entry) skip the scatter: a KV head's G rows of a token are one
  tile-aligned box of q itself.
- Work items are (work entry, KV head, KV split) triples. The grid is
  persistent: about one CTA per SM, each running a list of items that XLA
  builds per step (`_schedule`: items sorted by the KV blocks they read and
  dealt out in snake order, so the lists cost about the same), each item a row
  of its fields and its first block's page ids (`_item_rows`: one round of
  scalar loads before a CTA's first TMA, not four dependent ones). Each CTA runs
  `compute_wgs` consumer warpgroups (64 query rows each) and one producer
  warpgroup that streams KV blocks of `block_kv` tokens: one TMA per page
  (page_size x D, 128-byte swizzled) into a `num_stages`-deep ring that runs on
  across the CTA's items, so the next item's first blocks load while the
  current one finishes (with one CTA per item, each SM's ring drained at every
  item's end; bench/NOTES.md, Ragged paged attention: Persistent grid).
- Consumers: S = Q K^T (wgmma, f32), scale, optional soft cap, causal /
  kv_len / sliding-window mask on the edge blocks only, online softmax in base 2,
  O += P V (wgmma, accumulated in place). Masked scores are a large finite negative,
  not -inf, so a row whose first block is fully masked stays finite. Two consumers
  take turns on the tensor cores (`Config.pingpong`, FlashAttention-3's schedule
  barrier): one's softmax runs while the other's products do.
- Split-KV (flash decoding) when there are few (sequence, KV head) pairs: each
  split writes f32 partial outputs and their log-sum-exp; XLA combines them
  (sinks join there). Without splits the kernel writes q.dtype directly.
- Each CTA stores whole 64-row output tiles into its own slot of a per-entry
  buffer (TMA stores need static shapes and aligned shared-memory offsets); XLA
  gathers the live rows back into token order (and merges splits). Decode steps
  with queries in place and no splits store into out itself: the KV heads whose
  rows share a box of q's layout run one after another on one CTA, each adding
  its rows to the box in shared memory, the last storing it; padding tokens'
  items store zeros.
- fp8 (e4m3) pages: each KV block is upcast to f16 in shared memory (exact; queries
  and P run in f16 then), with one consumer by a warpgroup of its own into a ring of
  f16 blocks (`Config.fp8_upcaster`), with two by each consumer; k_scale folds into the
  score scale and v_scale into the output.

Named regions (`jax.named_scope`: wait_q, wait_k, qk, pv, wait_stores) mark the
consumer's waits and wgmmas for the Mosaic GPU profiler (`bench/attention_kernel_regions.py`).
On a machine without a GPU the same kernel runs in Mosaic GPU interpret mode
(tests). Constraints: Hopper (sm_90a), head_dim a multiple of 64 up to 256,
page_size a multiple of 8, G <= 64, q in bf16 or fp16.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jaxinfer.ops.attention import FP8_KV_DTYPE, AttentionMetadata, write_kv_pages
from jaxinfer.ops.platform import mosaic_interpret_params

ROWS = 64  # query rows per consumer warpgroup (the wgmma M tile)
MASKED = -1e30  # masked score (base-2 units): exp2(MASKED - m) == 0 for any real m
LOG2E = math.log2(math.e)
NUM_SMS = 132  # H100 / H200 SXM: the persistent grid's CTAs and the number of KV splits
UPCAST_STAGES = 2  # f16 blocks in the upcast warpgroup's ring (`Config.fp8_upcaster`)


@dataclasses.dataclass(frozen=True)
class Config:
    block_kv: int = 128  # KV tokens per pipeline step (a multiple of 64 and of page_size)
    num_stages: int = 2  # KV blocks in flight
    compute_wgs: int = 2  # consumer warpgroups per CTA, 64 query rows each
    num_splits: int = 1  # KV splits per (token block, KV head)
    # Query rows each warpgroup loads and stores (a multiple of 8, >= G): the wgmma
    # still computes 64 rows, but decode tiles move only the rows they use.
    tile_rows: int = ROWS
    num_ctas: int = NUM_SMS  # persistent CTAs (fewer when there are fewer work items)
    # Every KV block through the masked step (batch-invariant mode). Which blocks skip the
    # mask depends on where a row's work entry starts (how its prompt was chunked, the
    # configuration's entry size), and on an H200 the two steps gave a row other bits, if
    # rarely (bench/NOTES.md, Batch invariance: the mask on every KV block).
    mask_every_block: bool = False
    # Two consumer warpgroups take turns on the tensor cores (FlashAttention-3's ping-pong):
    # one's softmax runs while the other's QK^T and PV do. Only with compute_wgs == 2.
    pingpong: bool = True
    # fp8 pages with one consumer warpgroup: a warpgroup of its own converts each KV block
    # to f16 once, into a ring of UPCAST_STAGES blocks, so the upcast runs beside the
    # consumer's products instead of before them.
    fp8_upcaster: bool = True
    # One token an entry, its query rows loaded straight from q viewed as
    # [T * Hq / R, R, D] (R = tile_rows): a KV head's G rows of a token lie in one box, at
    # row (h G) % R, beside other heads' rows, which compute in their own rows unread.
    # No query scatter then, and without KV splits no output gather: the outputs go back
    # into the same boxes of out (`_box_heads`). On wherever the step allows it
    # (`queries_in_place_reason`), unless the caller passes a config.
    queries_in_place: bool = False


def choose_config(num_tokens: int, max_seqs: int, num_kv_heads: int, max_ctx: int,
                  head_dim: int, group: int, fp8: bool = False) -> Config:
    """Static heuristics: decode-like batches (about one token per sequence) use one
    consumer warpgroup, KV blocks of 64 tokens (128 on fp8 pages, whose upcast warpgroup
    was measured there) and split long contexts over the SMs (a split at least 512 tokens);
    prefill-heavy batches use two consumer warpgroups sharing each KV block."""
    decode_like = num_tokens <= 2 * max_seqs
    if not decode_like:
        return _prefill_config(head_dim)
    block_kv = _prefill_config(head_dim).block_kv if fp8 else 64
    tile_rows = min(ROWS, -(-group // 8) * 8)
    ctas = max(1, min(num_tokens, max_seqs)) * num_kv_heads
    splits = max(1, min(-(-2 * NUM_SMS // ctas), max_ctx // 512))
    return Config(block_kv=block_kv, num_stages=3, compute_wgs=1, num_splits=splits,
                  tile_rows=tile_rows)


def _prefill_config(head_dim: int) -> Config:
    """Prefill-heavy steps: two consumer warpgroups sharing each KV block, no splits."""
    return Config(block_kv=128 if head_dim <= 128 else 64, num_stages=2, compute_wgs=2,
                  num_splits=1)


def batch_invariant_config(cfg: Config, head_dim: int, q_dtype, kv_dtype) -> Config:
    """`cfg` made to give a query row the same bits in every step: a row's numbers depend
    on the KV block size (the online softmax rescales once a block), on the splits (their
    merge) and on which of its blocks skip the mask, not on the tile it shares with other
    rows (each row is its own wgmma row, its own softmax). So no splits, every block
    masked, and the block size of the prefill configuration after its shared-memory fit,
    which also fits every decode configuration (one consumer warpgroup needs less)."""
    prefill = _fit_stages(_prefill_config(head_dim), head_dim, q_dtype, kv_dtype)
    return dataclasses.replace(cfg, num_splits=1, block_kv=prefill.block_kv,
                               mask_every_block=True)


SMEM_BYTES = 227 * 1024  # Hopper's per-block shared memory limit


def queries_in_place_reason(cfg: Config, num_tokens: int, num_seqs: int, num_q_heads: int,
                            group: int) -> str | None:
    """Why `cfg` cannot load its queries straight from q for this step (None if it can).

    One consumer warpgroup and at most one token a sequence slot on average (each token
    becomes an entry of its own, so a sequence of k tokens reads its pages k times); the
    tile of R = tile_rows rows must hold whole KV heads (G divides R) and never cross a
    token (R divides Hq). On fp8 pages q is read in f16: its conversion fuses into the XLA
    op that makes q."""
    rows = cfg.tile_rows
    if cfg.compute_wgs != 1:
        return f"{cfg.compute_wgs} consumer warpgroups (one needed)"
    if num_tokens > num_seqs:
        return f"{num_tokens} tokens over {num_seqs} sequence slots (at most one each)"
    if rows % group or num_q_heads % rows:
        return f"tile_rows {rows}: must be a multiple of G {group} and divide Hq {num_q_heads}"
    return None


def _box_heads(cfg: Config, group: int) -> int | None:
    """KV heads whose output rows share one box of out viewed as [T Hq / R, R, D] (R =
    tile_rows), where the kernel stores its outputs straight into token order: queries in
    place and no KV splits (which XLA merges). None: output tiles, gathered by XLA."""
    if not cfg.queries_in_place or cfg.num_splits != 1:
        return None
    return cfg.tile_rows // group


def _fit_stages(cfg: Config, head_dim: int, q_dtype, kv_dtype) -> Config:
    """Lowers num_stages (to 2 at least), then halves block_kv (to 64 at least), until the
    kernel's shared memory fits. Why block_kv: fp8 pages with two consumer warpgroups
    (prefill) need each warpgroup's f16 copies of a K and a V block beside the pipeline:
    head_dim 128 at 128 tokens a block is 260 KB with 2 stages."""
    qb, kvb = jnp.dtype(q_dtype).itemsize, jnp.dtype(kv_dtype).itemsize
    out_b = 4 if cfg.num_splits > 1 else qb

    def smem(block_kv: int, stages: int) -> int:
        fixed = cfg.compute_wgs * ROWS * head_dim * (qb + out_b) + 4096  # q, out, lse, bars
        if kvb == 1:  # fp8: f16 copies of K and V, the upcaster's ring or per warpgroup
            copies = UPCAST_STAGES if _upcaster(cfg, True) else cfg.compute_wgs
            fixed += 2 * copies * block_kv * head_dim * qb
        return fixed + stages * 2 * block_kv * head_dim * kvb

    block_kv, stages = cfg.block_kv, cfg.num_stages
    while stages > 2 and smem(block_kv, stages) > SMEM_BYTES:
        stages -= 1
    while block_kv > 64 and smem(block_kv, stages) > SMEM_BYTES:
        block_kv //= 2
    return dataclasses.replace(cfg, num_stages=stages, block_kv=block_kv)


def _upcaster(cfg: Config, fp8: bool) -> bool:
    """Whether the kernel runs an upcast warpgroup (`Config.fp8_upcaster`)."""
    return fp8 and cfg.fp8_upcaster and cfg.compute_wgs == 1


def _max_entries(num_tokens: int, num_seqs: int, tokens_per_block: int) -> int:
    """The most work entries a step of T tokens over S sequence slots can need (static).

    A sequence of q >= 1 tokens needs ceil(q / b) <= (q + b - 1) / b entries (b =
    tokens_per_block), and at most min(S, T) sequences have a token, so all of them need
    at most (T + min(S, T) (b - 1)) / b: T for a decode step (T = S, b = 2). The query
    tiles, the output tiles and the schedule are sized by it."""
    b = tokens_per_block
    return max(1, (num_tokens + min(num_seqs, num_tokens) * (b - 1)) // b)


def _work_list(md: AttentionMetadata, num_entries: int, tokens_per_block: int):
    """[num_entries, 8] int32 rows (seq, first token, tokens, position of the first
    token, kv_len, 0, 0, 0); entries past the live blocks have 0 tokens."""
    S = md.kv_lens.shape[0]
    live = jnp.arange(S) < md.num_seqs[0]
    q_lens = jnp.where(live, md.cu_q_lens[1:] - md.cu_q_lens[:-1], 0)
    q_lens = jnp.maximum(q_lens, 0)
    blocks = -(-q_lens // tokens_per_block)
    ends = jnp.cumsum(blocks)
    entry = jnp.arange(num_entries, dtype=jnp.int32)
    # Compared all at once, not the default while loop (`token_positions` says why).
    seq = jnp.minimum(jnp.searchsorted(ends, entry, side="right", method="compare_all"),
                      S - 1).astype(jnp.int32)
    j = entry - (ends[seq] - blocks[seq])
    tokens = jnp.clip(q_lens[seq] - j * tokens_per_block, 0, tokens_per_block)
    tokens = jnp.where(entry < ends[-1], tokens, 0)
    first = md.cu_q_lens[seq] + j * tokens_per_block
    pos0 = md.kv_lens[seq] - q_lens[seq] + j * tokens_per_block
    zero = jnp.zeros_like(entry)
    cols = [seq, first, tokens, pos0, md.kv_lens[seq], zero, zero, zero]
    return jnp.stack([c.astype(jnp.int32) for c in cols], axis=1)


def _schedule(work, num_kv_heads: int, num_splits: int, num_ctas: int, block_kv: int,
              box_heads: int | None = None):
    """Deals the work items out to the persistent CTAs.

    Item i is (entry i // (Hkv * splits), KV head i // splits % Hkv, split i % splits).
    Items are sorted by cost (the KV blocks their entry reads; items of entries with no
    tokens cost 0 and come last) and dealt in snake order (CTA 0..C-1, then C-1..0, ...),
    which evens out the lists' costs. With `box_heads` (`_box_heads`: the kernel stores
    output boxes), the box_heads consecutive items whose rows share a box are dealt as one
    unit, in order, to one CTA (its last item stores the box), and items of entries with no
    tokens stay live (they store their box's rows as zeros). Returns (items [C, R] int32,
    -1 = none, and counts [C] int32: each list's live items, which come first).
    """
    unit = box_heads or 1
    per_entry = num_kv_heads * num_splits
    num_units = work.shape[0] * per_entry // unit
    rounds = -(-num_units // num_ctas)
    tokens, kv_end = work[:, 2], work[:, 3] + work[:, 2]
    cost = jnp.where(tokens > 0, (kv_end + block_kv - 1) // block_kv + 1, 0)
    if box_heads:
        cost = jnp.maximum(cost, 1)
    cost = jnp.repeat(cost, per_entry // unit)  # per unit
    if rounds == 1:  # one unit per CTA (e.g. small decode batches): nothing to balance
        units = jnp.where(cost > 0, jnp.arange(num_units, dtype=jnp.int32), -1)[:, None]
        counts = (cost > 0).astype(jnp.int32) * unit
    else:
        order = jnp.argsort(-cost, stable=True).astype(jnp.int32)
        k = jnp.arange(num_units, dtype=jnp.int32)
        r, lane = k // num_ctas, k % num_ctas
        cta = jnp.where(r % 2 == 0, lane, num_ctas - 1 - lane)
        live = cost[order] > 0
        units = jnp.full((num_ctas, rounds), -1, jnp.int32).at[cta, r].set(
            jnp.where(live, order, -1))
        counts = jnp.zeros(num_ctas, jnp.int32).at[cta].add(live.astype(jnp.int32) * unit)
    items = jnp.where(units[..., None] >= 0,
                      units[..., None] * unit + jnp.arange(unit, dtype=jnp.int32), -1)
    return items.reshape(units.shape[0], -1), counts


# The fields of an item's row in the table the kernel reads (`_item_rows`), then the
# page ids of its first KV block.
ITEM_FIELDS = ("kv_head", "entry", "split", "seq", "tokens", "pos0", "kv_len", "first_block",
               "blocks")


def _item_rows(items, work, page_indices, *, num_kv_heads: int, num_splits: int,
               block_kv: int, page_size: int, sliding_window: int | None):
    """items [C, R] (`_schedule`) -> [C, R, len(ITEM_FIELDS) + block_kv // page_size] int32:
    each item's fields, then the page ids of its first KV block (dead items: garbage).

    Built by XLA once per step (every layer's call shares it), so that a CTA's first KV
    loads wait on one round of scalar loads (its row) instead of four dependent ones
    (its count, its item, the item's work entry, the page ids). Pages past kv_len read the
    sequence's first page instead (finite values; those columns are masked).
    """
    i = jnp.maximum(items, 0)
    split = i % num_splits
    h = i // num_splits % num_kv_heads
    entry = i // (num_splits * num_kv_heads)
    seq, num_tokens, pos0, kv_len = (work[entry, c] for c in (0, 2, 3, 4))
    # KV blocks this item reads: causal end, sliding-window start, then this split's share.
    kv_end = pos0 + num_tokens
    kv_begin = jnp.zeros_like(kv_end)
    if sliding_window is not None:
        kv_begin = jnp.maximum(pos0 - sliding_window + 1, 0)
    blk_begin = kv_begin // block_kv
    blk_count = jnp.where(num_tokens > 0, (kv_end + block_kv - 1) // block_kv - blk_begin, 0)
    per_split = (blk_count + num_splits - 1) // num_splits
    lo = blk_begin + jnp.minimum(split * per_split, blk_count)
    steps = jnp.maximum(jnp.minimum(per_split, blk_begin + blk_count - lo), 0)
    pages_per_block = block_kv // page_size
    slot = lo[..., None] * pages_per_block + jnp.arange(pages_per_block)
    valid = slot * page_size < kv_len[..., None]
    max_pages = page_indices.shape[1]
    ids = page_indices[seq[..., None], jnp.where(valid, jnp.minimum(slot, max_pages - 1), 0)]
    fields = jnp.stack([h, entry, split, seq, num_tokens, pos0, kv_len, lo, steps], axis=-1)
    return jnp.concatenate([fields, ids], axis=-1).astype(jnp.int32)


def _attention_kernel(item_rows_ref, counts_ref, page_indices_ref, q_ref, k_pages_ref,
                      v_pages_ref, sinks_ref, out_ref, lse_ref, scratch, *, cfg: Config,
                      group: int, num_q_heads: int, head_dim: int, page_size: int,
                      sm_scale: float,
                      sliding_window: int | None, soft_cap: float | None, fp8: bool,
                      v_scale: float | None, box_heads: int | None):
    (q_smem, k_smem, v_smem, o_smem, lse_smem, k16_smem, v16_smem, p_smem,
     k_ready, v_ready, q_ready, k_free, v_free, turn,
     k16_ready, v16_ready, k16_free, v16_free) = scratch
    upcaster = k16_ready is not None
    cta, wg = lax.axis_index("cta"), lax.axis_index("wg")
    bk, stages, wgs, splits = cfg.block_kv, cfg.num_stages, cfg.compute_wgs, cfg.num_splits
    pages_per_block = bk // page_size
    tile_rows = cfg.tile_rows
    in_place = cfg.queries_in_place
    tokens_per_wg = 1 if in_place else tile_rows // group
    max_pages = page_indices_ref.shape[1]
    max_items = item_rows_ref.shape[1]
    num_items = counts_ref[cta]

    def item(j):
        """This CTA's j-th item: (KV head, entry, split, seq, tokens, pos0, kv_len, first
        KV block, KV blocks), one independent scalar load each (`_item_rows`)."""
        return tuple(item_rows_ref[cta, j, f] for f in range(len(ITEM_FIELDS)))

    def first_page_ids(j):
        return tuple(item_rows_ref[cta, j, len(ITEM_FIELDS) + p]
                     for p in range(pages_per_block))

    def drain(total, depth: int, k_free_ref, v_free_ref):
        # Observe a ring's last releases too (those of blocks total - depth .. total - 1),
        # so that no barrier phase this thread arrives on is left unobserved when it exits
        # (on the GPU the consumer is finishing anyway; the interpret-mode tests pass
        # without it too).
        def wait_free(t):
            slot = lax.rem(t, jnp.int32(depth))
            plgpu.barrier_wait(k_free_ref.at[slot])
            plgpu.barrier_wait(v_free_ref.at[slot])

        for i in range(depth):
            pl.when(total + i >= depth)(functools.partial(wait_free, total + i))

    @pl.when(wg == wgs)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")

        def run_item(j, carry):
            """Streams item j's KV blocks; t0 counts the blocks of the CTA's earlier items
            (the ring's position). Item j's row came with the carry, loaded during item
            j - 1 (the first one before the loop, alongside the CTA's item count)."""
            t0, fields, first_ids = carry
            nxt = jnp.minimum(j + 1, max_items - 1)
            next_row = item(nxt), first_page_ids(nxt)
            h, _, _, seq, _, _, kv_len, lo, steps = fields

            def page_ids(block):
                # One scalar load per page, all issued before any TMA that uses them (and a
                # step ahead of use), so their latency overlaps instead of adding up.
                # Pages past kv_len may be anything (and any id): read the sequence's first
                # page instead, whose values are finite; those columns are masked.
                ids = []
                for p in range(pages_per_block):
                    page_slot = block * pages_per_block + p
                    valid = page_slot * page_size < kv_len
                    ids.append(page_indices_ref[seq, jnp.where(
                        valid, jnp.minimum(page_slot, max_pages - 1), 0)])
                return tuple(ids)

            def load(pages_ref, smem, barrier, ids):
                for p, page in enumerate(ids):
                    plgpu.copy_gmem_to_smem(pages_ref.at[page, :, h, :],
                                            smem.at[pl.ds(p * page_size, page_size)], barrier)

            def produce(step, ids):
                t = t0 + step
                slot = lax.rem(t, jnp.int32(stages))
                next_ids = page_ids(lo + step + 1)

                @pl.when(t >= stages)
                def _():
                    plgpu.barrier_wait(k_free.at[slot])
                load(k_pages_ref, k_smem.at[slot], k_ready.at[slot], ids)

                @pl.when(t >= stages)
                def _():
                    plgpu.barrier_wait(v_free.at[slot])
                load(v_pages_ref, v_smem.at[slot], v_ready.at[slot], ids)
                return next_ids

            lax.fori_loop(0, steps, produce, first_ids)
            return (t0 + steps, *next_row)

        total, _, _ = lax.fori_loop(0, num_items, run_item,
                                    (jnp.int32(0), item(0), first_page_ids(0)))
        drain(total, stages, k_free, v_free)

    if upcaster:
        @pl.when(wg == wgs + 1)
        def _upcaster():
            def convert(src, dst):
                # A warpgroup's registers hold 64 rows at a time (fp8 -> f16 is exact).
                for r in range(0, bk, ROWS):
                    dst.at[pl.ds(r, ROWS)][...] = plgpu.load(
                        src.at[pl.ds(r, ROWS)], layout=plgpu.Layout.WGMMA).astype(dst.dtype)
                plgpu.commit_smem()

            def upcast_block(t, carry):
                slot = lax.rem(t, jnp.int32(stages))
                slot16 = lax.rem(t, jnp.int32(UPCAST_STAGES))
                for ready, free, src, ready16, free16, dst in (
                        (k_ready, k_free, k_smem, k16_ready, k16_free, k16_smem),
                        (v_ready, v_free, v_smem, v16_ready, v16_free, v16_smem)):
                    plgpu.barrier_wait(ready.at[slot])
                    pl.when(t >= UPCAST_STAGES)(
                        functools.partial(plgpu.barrier_wait, free16.at[slot16]))
                    convert(src.at[slot], dst.at[slot16])
                    plgpu.barrier_arrive(ready16.at[slot16])
                    plgpu.barrier_arrive(free.at[slot])
                return carry

            # The CTA's blocks, in the producer's order (its items' blocks one after another).
            total = lax.fori_loop(0, num_items, lambda j, n: n + item(j)[8], jnp.int32(0))
            lax.fori_loop(0, total, upcast_block, jnp.int32(0))
            drain(total, UPCAST_STAGES, k16_free, v16_free)

    pingpong = turn is not None

    def take_turn():
        # Both consumers arrive, then wait: the tensor cores pass to the other warpgroup.
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    @pl.when(wg < wgs)
    def _consumer():
        plgpu.set_max_registers(232 if wgs > 1 else 240, action="increase")
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        rows = plgpu.broadcasted_iota(jnp.int32, (ROWS, bk), 0, layout=plgpu.Layout.WGMMA)
        cols = plgpu.broadcasted_iota(jnp.int32, (ROWS, bk), 1, layout=plgpu.Layout.WGMMA)
        score_scale = sm_scale * LOG2E

        def load_q(j):
            # Only tile_rows query rows are loaded; the other rows of the 64-row wgmma tile
            # hold stale values, and every row's softmax and output are its own.
            h, entry = item(j)[:2]
            if in_place:  # entry e is token e; its KV head h's rows: box (e Hq + h G) / R
                src = q_ref.at[entry * (num_q_heads // tile_rows)
                               + lax.div(h * group, jnp.int32(tile_rows))]
            else:
                src = q_ref.at[h, entry, pl.ds(wg * tile_rows, tile_rows)]
            plgpu.copy_gmem_to_smem(src, q_smem.at[wg, pl.ds(0, tile_rows)], q_ready.at[wg])

        load_q(0)  # before the item count is known (a CTA without items waits for it below)
        if pingpong:  # the second warpgroup starts a turn behind; the first ends one behind
            pl.when(wg == 1)(take_turn)

        def upcast(src, dst):
            # fp8 pages -> f16 copy in shared memory (exact), for wgmma.
            dst[...] = plgpu.load(src, layout=plgpu.Layout.WGMMA).astype(dst.dtype)
            plgpu.commit_smem()

        def ring(t):
            """The slot of the t-th KV block of this CTA and its (ready, free, tile) for K
            and for V: the producer's ring, or the upcast warpgroup's f16 ring."""
            if upcaster:
                slot = lax.rem(t, jnp.int32(UPCAST_STAGES))
                return (slot, (k16_ready, k16_free, k16_smem.at[slot]),
                        (v16_ready, v16_free, v16_smem.at[slot]))
            slot = lax.rem(t, jnp.int32(stages))
            return (slot, (k_ready, k_free, k_smem.at[slot]),
                    (v_ready, v_free, v_smem.at[slot]))

        def store_box(out, h, entry):
            """An item's output [ROWS, D] f32 (`box_heads`): its G rows into the box of out
            [T Hq / R, R, D] it shares with the box's other KV heads, which come just before
            it on this CTA and left their rows in o_smem; the box's last head stores it. The
            caller has waited for the previous box's store to read o_smem."""
            out = out.astype(o_smem.dtype)
            if box_heads > 1:
                first = lax.rem(h, jnp.int32(box_heads)) * group  # this head's first row
                out_rows = plgpu.broadcasted_iota(jnp.int32, (ROWS, head_dim), 0,
                                                  layout=plgpu.Layout.WGMMA)
                mine = (out_rows >= first) & (out_rows < first + group)
                out = jnp.where(mine, out, plgpu.load(o_smem.at[wg],
                                                      layout=plgpu.Layout.WGMMA))
            o_smem.at[wg][...] = out
            plgpu.commit_smem()

            @pl.when(lax.rem(h, jnp.int32(box_heads)) == box_heads - 1)
            def _():
                box = entry * (num_q_heads // tile_rows) + lax.div(h * group,
                                                                    jnp.int32(tile_rows))
                plgpu.copy_smem_to_gmem(o_smem.at[wg, pl.ds(0, tile_rows)], out_ref.at[box])

        def next_q(j):
            # Every wgmma that read q_smem has finished (its scores were read): the next
            # item's queries may load.
            @pl.when(j + 1 < num_items)
            def _():
                load_q(j + 1)

        def pass_block(i, t0):
            """A block's barriers as `step` meets them (its turns included), without its
            products: for a warpgroup with no rows in the item."""
            slot, (k_ready_, k_free_, _), (v_ready_, v_free_, _) = ring(t0 + i)
            plgpu.barrier_wait(k_ready_.at[slot])
            if pingpong:
                take_turn()
            plgpu.barrier_arrive(k_free_.at[slot])
            if pingpong:
                plgpu.barrier_arrive(turn)
                plgpu.barrier_wait(v_ready_.at[slot])
                plgpu.barrier_wait(turn)
            else:
                plgpu.barrier_wait(v_ready_.at[slot])
            plgpu.barrier_arrive(v_free_.at[slot])
            return t0

        def run_item(j, t0):
            h, entry, split, _, num_tokens, pos0, kv_len, lo, steps = item(j)
            wg_first = jnp.minimum(wg * tokens_per_wg, num_tokens)  # token offset in the block
            wg_tokens = jnp.clip(num_tokens - wg * tokens_per_wg, 0, tokens_per_wg)
            with jax.named_scope("wait_q"):
                plgpu.barrier_wait(q_ready.at[wg])

            @pl.when(wg_tokens > 0)
            def _attend():
                m_i = plgpu.layout_cast(jnp.full((ROWS,), MASKED, jnp.float32), row_layout)
                l_i = plgpu.layout_cast(jnp.full((ROWS,), 0.0, jnp.float32), row_layout)
                acc = plgpu.layout_cast(jnp.full((ROWS, head_dim), 0.0, jnp.float32),
                                        plgpu.Layout.WGMMA)
                # A row's token within the warpgroup's share (in place: every row of the box
                # is the entry's one token, other heads' rows included).
                row_token = rows * 0 if in_place else lax.div(rows, jnp.int32(group))
                q_pos = pos0 + wg_first + row_token
                row_live = row_token < wg_tokens

                def step(i, carry, masked: bool):
                    acc, m_i, l_i = carry
                    block = lo + i
                    slot, (k_ready_, k_free_, k_tile), (v_ready_, v_free_, v_tile) = ring(t0 + i)
                    with jax.named_scope("wait_k"):
                        plgpu.barrier_wait(k_ready_.at[slot])
                    if fp8 and not upcaster:
                        upcast(k_tile, k16_smem.at[wg])
                        k_tile = k16_smem.at[wg]

                    def qk(acc_ref):
                        plgpu.wgmma(acc_ref, q_smem.at[wg], k_tile.transpose((1, 0)))
                        if pingpong:  # while this product runs, the other's softmax ends
                            take_turn()
                        return acc_ref[...]
                    with jax.named_scope("qk"):
                        s = pl.run_scoped(qk, plgpu.ACC((ROWS, bk), jnp.float32))
                    plgpu.barrier_arrive(k_free_.at[slot])
                    if soft_cap is not None:
                        s = jnp.tanh(s * (sm_scale / soft_cap)) * (soft_cap * LOG2E)
                    else:
                        s = s * score_scale
                    if masked:
                        kv_pos = block * bk + cols
                        keep = (kv_pos <= q_pos) & (kv_pos < kv_len) & row_live
                        if sliding_window is not None:
                            keep = keep & (q_pos - kv_pos < sliding_window)
                        s = jnp.where(keep, s, MASKED)
                    m_new = jnp.maximum(m_i, s.max(axis=1))
                    alpha = jnp.exp2(m_i - m_new)
                    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                    l_i = l_i * alpha + p.sum(axis=1)
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                    if pingpong:
                        # The softmax done (the barrier keeps its math ahead of the turn),
                        # hand over, then wait until the other's QK^T has been issued.
                        acc, l_i, m_new, p = lax.optimization_barrier((acc, l_i, m_new, p))
                        plgpu.barrier_arrive(turn)
                        plgpu.barrier_wait(v_ready_.at[slot])
                        plgpu.barrier_wait(turn)
                    else:
                        plgpu.barrier_wait(v_ready_.at[slot])
                    if fp8 and not upcaster:
                        upcast(v_tile, v16_smem.at[wg])
                        v_tile = v16_smem.at[wg]

                    p16 = p.astype(q_smem.dtype)
                    if p_smem is not None:  # interpret mode: wgmma's A operand must be in SMEM
                        p_smem.at[wg][...] = p16
                        plgpu.commit_smem()
                        p16 = p_smem.at[wg]

                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, p16, v_tile)
                        return acc_ref[...]
                    with jax.named_scope("pv"):
                        if p_smem is None:  # on the GPU: accumulate into acc in place
                            acc = pl.run_state(lambda r: plgpu.wgmma(r, p16, v_tile))(
                                plgpu.ACC.init(acc))
                        else:  # interpret mode has no preinitialised accumulator
                            acc = acc + pl.run_scoped(pv, plgpu.ACC((ROWS, head_dim),
                                                                    jnp.float32))
                    plgpu.barrier_arrive(v_free_.at[slot])
                    return acc, m_new, l_i

                # Blocks that need no mask: inside every token's window (the last token's starts
                # latest) and at or before the first token causally (so kv_len cannot bite).
                full_lo = jnp.int32(0)
                if cfg.mask_every_block:
                    full_lo = steps
                elif sliding_window is not None:
                    last_pos = pos0 + num_tokens - 1
                    full_lo = (jnp.maximum(last_pos - sliding_window + 1, 0) + bk - 1) // bk - lo
                full_hi = (pos0 + 1) // bk - lo
                a = jnp.clip(full_lo, 0, steps)
                b = jnp.clip(full_hi, a, steps)
                carry = (acc, m_i, l_i)
                carry = lax.fori_loop(0, a, functools.partial(step, masked=True), carry)
                carry = lax.fori_loop(a, b, functools.partial(step, masked=False), carry)
                acc, m_i, l_i = lax.fori_loop(b, steps, functools.partial(step, masked=True),
                                              carry)

                next_q(j)  # while this item's output is written

                # The previous item's output stores must have read o_smem / lse_smem.
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                if splits == 1:
                    if sinks_ref is not None:
                        sink = plgpu.load(sinks_ref.at[h], layout=row_layout,
                                          optimized=False) * LOG2E
                        m_new = jnp.maximum(m_i, sink)
                        alpha = jnp.exp2(m_i - m_new)
                        l_i = l_i * alpha + jnp.exp2(sink - m_new)
                        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                    out = acc / lax.broadcast_in_dim(l_i, acc.shape, [0])
                    if v_scale is not None:
                        out = out * v_scale
                    if box_heads:
                        store_box(out, h, entry)
                    else:
                        o_smem.at[wg][...] = out.astype(o_smem.dtype)
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(o_smem.at[wg, pl.ds(0, tile_rows)],
                                                out_ref.at[0, h, entry,
                                                           pl.ds(wg * tile_rows, tile_rows)])
                else:
                    l_safe = jnp.where(l_i == 0, 1.0, l_i)
                    out = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
                    if v_scale is not None:
                        out = out * v_scale
                    # Natural-log LSE; an empty split has l = 0 -> -inf (weight 0 in the
                    # combine).
                    lse = jnp.where(l_i == 0, -jnp.inf, (m_i + jnp.log2(l_safe)) / LOG2E)
                    o_smem.at[wg][...] = out.astype(o_smem.dtype)
                    lse_smem.at[wg][...] = lse
                    plgpu.commit_smem()
                    rows_out = pl.ds(wg * tile_rows, tile_rows)
                    plgpu.copy_smem_to_gmem(o_smem.at[wg, pl.ds(0, tile_rows)],
                                            out_ref.at[split, h, entry, rows_out])
                    plgpu.copy_smem_to_gmem(lse_smem.at[wg, pl.ds(0, tile_rows)],
                                            lse_ref.at[split, h, entry, rows_out])

            # A warpgroup with no rows of this item (a decode in a two-warpgroup step has
            # one token, in the first): its products would only hold the tensor cores,
            # which the two take in turns, so it passes the blocks through the barriers
            # alone, as the other computes them.
            @pl.when(wg_tokens == 0)
            def _pass():
                lax.fori_loop(0, steps, pass_block, t0)
                next_q(j)
                if box_heads:  # a padding token (`_schedule`): its rows of out are 0
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    store_box(plgpu.layout_cast(jnp.full((ROWS, head_dim), 0.0, jnp.float32),
                                                plgpu.Layout.WGMMA), h, entry)

            return t0 + steps

        lax.fori_loop(0, num_items, run_item, jnp.int32(0))
        if pingpong:
            pl.when(wg == 0)(take_turn)

        @pl.when(num_items == 0)
        def _():
            plgpu.barrier_wait(q_ready.at[wg])
        with jax.named_scope("wait_stores"):
            plgpu.wait_smem_to_gmem(0)


def _tile_rows(work, group: int, cfg: Config):
    """For each (entry, tile row): (token, query head within the KV head, is it live).

    Warpgroup w of an entry owns tile rows [R w, R w + R) (R = cfg.tile_rows): row
    R w + i is token w * (R // G) + i // G of the entry, query head i % G.
    """
    rows = cfg.tile_rows
    tokens_per_wg = rows // group
    lr = jnp.arange(cfg.compute_wgs * rows)[None, :]
    wg, i = lr // rows, lr % rows
    local_token = wg * tokens_per_wg + i // group
    live = (i < tokens_per_wg * group) & (local_token < work[:, 2:3])
    return work[:, 1:2] + local_token, i % group, live


def _query_rows(work, num_tokens: int, num_kv_heads: int, group: int, cfg: Config):
    """For each (token t, KV head h, query head g within it): the row of the tiles viewed
    as [Hkv * entries * R', D] (R' = wgs * R rows an entry) that computes it -> [T, Hkv, G]
    int32. A padding token's rows lie past the tiles, each its own, so that the rows are
    unique (the query scatter is told so)."""
    token, g, live = _tile_rows(work, group, cfg)  # [entries, R']
    tiles = token.size  # rows of one KV head's tiles
    # Invert _tile_rows: which tile row computed each (token, query head within its KV head).
    dest = jnp.where(live, token * group + g, num_tokens * group).ravel()  # dead: dropped
    src = jnp.full(num_tokens * group, tiles, jnp.int32).at[dest].set(
        jnp.arange(dest.shape[0], dtype=jnp.int32), mode="drop")  # unset: out of range
    src = src.reshape(num_tokens, 1, group)
    h = jnp.arange(num_kv_heads, dtype=jnp.int32)[None, :, None]
    past = num_kv_heads * tiles + jnp.arange(num_tokens * num_kv_heads * group,
                                             dtype=jnp.int32).reshape(src.shape[0], -1, group)
    rows = jnp.where(src < tiles, h * tiles + src, past)
    # Computed once, behind a barrier: fused into the gathers and the scatter that use them,
    # XLA recomputed the work list's cumulative sums for every element they move.
    return jax.lax.optimization_barrier(rows)


def _query_rows_in_place(md: AttentionMetadata, num_tokens: int, num_kv_heads: int,
                         group: int, cfg: Config):
    """`_query_rows` for `Config.queries_in_place`: token t is entry t, and query head g of
    KV head h sits at row (h G) % R + g of its tile (R = tile_rows). Padding tokens' rows
    lie past the tiles (their outputs read back as 0)."""
    rows = cfg.tile_rows
    t = jnp.arange(num_tokens, dtype=jnp.int32)[:, None, None]
    h = jnp.arange(num_kv_heads, dtype=jnp.int32)[None, :, None]
    g = jnp.arange(group, dtype=jnp.int32)[None, None, :]
    tiles = num_tokens * rows  # rows of one KV head's tiles
    live = t < md.cu_q_lens[md.num_seqs[0]]
    return jnp.where(live, h * tiles + t * rows + (h * group) % rows + g, num_kv_heads * tiles)


def _uninitialized(shape, dtype):
    """A buffer whose values are whatever its memory held (zeros off the GPU)."""
    return jax.lax.empty(shape, dtype)


def _tile_queries(q, rows, num_entries: int, cfg: Config, dtype):
    """q [T, Hq, D] -> per-entry query tiles [Hkv, entries, wgs * R, D] in `dtype`, given
    each query row's tile row (`_query_rows`).

    Tiles, not q itself, because a TMA load into tiled shared memory needs a
    tile-aligned global offset, which a ragged token start is not. One scatter of whole
    D-element rows into an uninitialized buffer: it writes the live rows only (a decode
    entry uses G of its rows, a prefill step's decodes G of 128). The kernel reads the
    dead rows too; their values reach only their own rows of S, P and O (each query row
    is a wgmma row of its own, with its own softmax), which no one reads back.
    """
    T, Hq, D = q.shape
    hkv = rows.shape[1]
    shape = (hkv, num_entries, cfg.compute_wgs * cfg.tile_rows, D)
    tiles = _uninitialized((math.prod(shape[:-1]), D), dtype)
    tiles = tiles.at[rows.reshape(-1)].set(q.reshape(T * Hq, D).astype(dtype), mode="drop",
                                           unique_indices=True)
    return tiles.reshape(shape)


def _gather_rows(out, lse, rows, sinks):
    """Per-entry output tiles -> out [T, Hq, D], merging KV splits.

    out [splits, Hkv, entries, wgs * R, D] (f32 and normalized per split when
    splits > 1), lse [splits, Hkv, entries, wgs * R] or None, rows [T, Hkv, G]
    (`_query_rows`). Row (t, h * G + g) of the result is token t, query head g of KV head
    h; rows no tile computed (padding tokens) are 0. One gather of whole rows of the tiles
    viewed as [splits, Hkv * entries * R, D], straight into token order (no transpose
    after).
    """
    splits, hkv, entries, rows_per_entry, D = out.shape
    tiles = entries * rows_per_entry
    num_tokens, _, group = rows.shape
    row = rows.reshape(-1)
    out_rows = jnp.take(out.reshape(splits, hkv * tiles, D), row, axis=1, mode="fill",
                        fill_value=0)  # [splits, T * Hq, D]
    if lse is None:
        return out_rows[0].reshape(num_tokens, hkv * group, D)
    lse_rows = jnp.take(lse.reshape(splits, hkv * tiles), row, axis=1, mode="fill",
                        fill_value=-jnp.inf)  # [splits, T * Hq]
    m = jnp.max(lse_rows, axis=0)
    if sinks is not None:
        sink = jnp.tile(sinks.astype(jnp.float32), num_tokens)  # [T * Hq]: head (t, q)
        m = jnp.maximum(m, sink)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse_rows - m[None])
    denom = jnp.sum(w, axis=0)
    if sinks is not None:
        denom = denom + jnp.exp(sink - m)
    w = w / jnp.where(denom == 0, 1.0, denom)[None]
    merged = jnp.sum(jnp.where(w[..., None] > 0, out_rows, 0.0) * w[..., None], axis=0)
    return merged.reshape(num_tokens, hkv * group, D)


def ragged_paged_attention_mgpu(
    q, k, v, k_pages, v_pages, md: AttentionMetadata, *,
    sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
    sinks: jax.Array | None = None, k_scale: float | None = None, v_scale: float | None = None,
    config: Config | None = None, batch_invariant: bool = False,
):
    """Writes k/v into the pages and attends with the Mosaic GPU kernel (see module doc).
    batch_invariant: a token's output has the same bits whatever the step holds beside it
    (`batch_invariant_config`)."""
    k_pages, v_pages = write_kv_pages(k, v, k_pages, v_pages, md, k_scale=k_scale,
                                      v_scale=v_scale)
    out = attend_pages_mgpu(q, k_pages, v_pages, md, sm_scale=sm_scale,
                            sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks,
                            k_scale=k_scale, v_scale=v_scale, config=config,
                            batch_invariant=batch_invariant)
    return out, k_pages, v_pages


# Jitted so that the layers of a model, which call it with the same shapes and options,
# share one trace and one lowering of the kernel (lowering it once per layer made a
# 32-layer step take about a minute to compile).
@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap",
                                             "k_scale", "v_scale", "config",
                                             "batch_invariant"))
def attend_pages_mgpu(
    q, k_pages, v_pages, md: AttentionMetadata, *,
    sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
    sinks: jax.Array | None = None, k_scale: float | None = None, v_scale: float | None = None,
    config: Config | None = None, batch_invariant: bool = False,
):
    """The attention half: pages that already hold this step's k/v -> out [T, Hq, D]."""
    T, Hq, D = q.shape
    num_pages, page_size, Hkv, _ = k_pages.shape
    S, P = md.page_indices.shape
    G = Hq // Hkv
    if (reason := unsupported_reason(q, k_pages)) is not None:
        raise ValueError(f"mosaic attention: {reason}")
    fp8 = k_pages.dtype == FP8_KV_DTYPE
    # fp8 pages are upcast to f16 (one cvt instruction; e4m3 -> bf16 has none), so the
    # queries and P run in f16 too: exact for e4m3 and P, and q's range fits f16.
    compute_dtype = jnp.float16 if fp8 else q.dtype
    cfg = config or choose_config(T, S, Hkv, P * page_size, D, G, fp8)
    if batch_invariant:
        cfg = batch_invariant_config(cfg, D, q.dtype, k_pages.dtype)
    if cfg.tile_rows % 8 or not G <= cfg.tile_rows <= ROWS:
        raise ValueError(f"mosaic attention: tile_rows {cfg.tile_rows}: a multiple of 8 "
                         f"in [{G}, {ROWS}] required")
    bk = cfg.block_kv
    if bk % 64 or bk % page_size:
        raise ValueError(f"mosaic attention: block_kv {bk} must be a multiple of 64 and of "
                         f"page_size {page_size}")

    reason = queries_in_place_reason(cfg, T, S, Hq, G)
    if config is None:
        cfg = dataclasses.replace(cfg, queries_in_place=reason is None)
    elif cfg.queries_in_place and reason is not None:
        raise ValueError(f"mosaic attention: queries_in_place: {reason}")
    cfg = _fit_stages(cfg, D, q.dtype, k_pages.dtype)
    bk = cfg.block_kv  # the fit may halve it
    page_indices = jnp.clip(md.page_indices, 0, num_pages - 1)

    box_heads = _box_heads(cfg, G)
    if cfg.queries_in_place:  # one token an entry, its rows read from q itself
        num_entries = T
        work = _work_list(md, num_entries, 1)
        rows = None if box_heads else _query_rows_in_place(md, T, Hkv, G, cfg)
        q_tiles = q.astype(compute_dtype).reshape(T * Hq // cfg.tile_rows, cfg.tile_rows, D)
    else:
        tokens_per_block = cfg.compute_wgs * (cfg.tile_rows // G)
        num_entries = _max_entries(T, S, tokens_per_block)
        work = _work_list(md, num_entries, tokens_per_block)
        rows = _query_rows(work, T, Hkv, G, cfg)
        q_tiles = _tile_queries(q, rows, num_entries, cfg, compute_dtype)

    split = cfg.num_splits > 1
    out_dtype = jnp.float32 if split else q.dtype
    rows_per_entry = cfg.compute_wgs * cfg.tile_rows
    if box_heads:  # out itself, in boxes of R rows
        out_type = [jax.ShapeDtypeStruct((T * Hq // cfg.tile_rows, cfg.tile_rows, D), q.dtype)]
    else:
        out_type = [jax.ShapeDtypeStruct(
            (cfg.num_splits, Hkv, num_entries, rows_per_entry, D), out_dtype)]
    if split:
        out_type.append(jax.ShapeDtypeStruct(
            (cfg.num_splits, Hkv, num_entries, rows_per_entry), jnp.float32))
    sinks_rows = None
    if sinks is not None and not split:
        # Per query row of a warpgroup tile: row r is query head r % G of the KV head.
        sinks_rows = jnp.tile(sinks.astype(jnp.float32).reshape(Hkv, 1, G),
                              (1, -(-ROWS // G), 1)).reshape(Hkv, -1)[:, :ROWS]

    interpret = mosaic_interpret_params()

    def swizzled(dtype):
        # Rows of D elements, swizzled by the widest pattern a row fills (<= 128 bytes).
        row_bytes = min(128, D * jnp.dtype(dtype).itemsize)
        return (plgpu.TilingTransform((8, row_bytes // jnp.dtype(dtype).itemsize)),
                plgpu.SwizzleTransform(row_bytes))
    wgs, stages = cfg.compute_wgs, cfg.num_stages
    upcaster = _upcaster(cfg, fp8)
    copies = UPCAST_STAGES if upcaster else wgs  # f16 K / V blocks (fp8 pages)
    scratch = [
        plgpu.SMEM((wgs, ROWS, D), compute_dtype, transforms=swizzled(compute_dtype)),
        plgpu.SMEM((stages, bk, D), k_pages.dtype, transforms=swizzled(k_pages.dtype)),
        plgpu.SMEM((stages, bk, D), k_pages.dtype, transforms=swizzled(k_pages.dtype)),
        plgpu.SMEM((wgs, ROWS, D), out_dtype, transforms=swizzled(out_dtype)),
        plgpu.SMEM((wgs, ROWS), jnp.float32) if split else None,
        plgpu.SMEM((copies, bk, D), compute_dtype, transforms=swizzled(compute_dtype))
        if fp8 else None,
        plgpu.SMEM((copies, bk, D), compute_dtype, transforms=swizzled(compute_dtype))
        if fp8 else None,
        # P goes through shared memory only in interpret mode (no register A operand there).
        plgpu.SMEM((wgs, ROWS, bk), compute_dtype, transforms=swizzled(compute_dtype))
        if interpret
        else None,
    ]
    barriers = (
        plgpu.Barrier(num_arrivals=bk // page_size, num_barriers=stages),
        plgpu.Barrier(num_arrivals=bk // page_size, num_barriers=stages),
        plgpu.Barrier(num_barriers=wgs),
        # The fp8 ring's slots are freed by whoever reads them: the upcaster, or the consumers.
        plgpu.Barrier(num_arrivals=1 if upcaster else wgs, num_barriers=stages),
        plgpu.Barrier(num_arrivals=1 if upcaster else wgs, num_barriers=stages),
    )
    # The consumers' turn on the tensor cores (`Config.pingpong`); none: no turns.
    turn = [plgpu.Barrier(num_arrivals=wgs)] if cfg.pingpong and wgs == 2 else []
    # The upcaster's f16 ring: k16 / v16 ready (it arrives), k16 / v16 free (consumers do).
    ring16 = ([plgpu.Barrier(num_barriers=UPCAST_STAGES)] * 2
              + [plgpu.Barrier(num_arrivals=wgs, num_barriers=UPCAST_STAGES)] * 2
              if upcaster else [])
    kernel_fn = functools.partial(
        _attention_kernel, cfg=cfg, group=G, num_q_heads=Hq, head_dim=D, page_size=page_size,
        sm_scale=sm_scale * (k_scale if (fp8 and k_scale is not None) else 1.0),
        sliding_window=sliding_window, soft_cap=soft_cap, fp8=fp8,
        v_scale=v_scale if fp8 else None, box_heads=box_heads)

    def entry(item_rows_ref, counts_ref, pages_ref, q_ref, kp_ref, vp_ref, *rest):
        if sinks_rows is not None:
            sinks_ref, *rest = rest
        else:
            sinks_ref = None
        out_ref, lse_ref = (rest[0], rest[1]) if split else (rest[0], None)
        def run(scratch_refs, *bars):
            # The barriers of absent parts as None: no turns, no upcaster.
            base, rest = bars[:len(barriers)], list(bars[len(barriers):])
            turn_ref = rest.pop(0) if turn else None
            ring16_refs = tuple(rest) if ring16 else (None,) * 4
            kernel_fn(item_rows_ref, counts_ref, pages_ref, q_ref, kp_ref, vp_ref, sinks_ref,
                      out_ref, lse_ref, (*scratch_refs, *base, turn_ref, *ring16_refs))

        pl.run_scoped(run, scratch, *barriers, *turn, *ring16, collective_axes="wg")

    num_units = num_entries * Hkv * cfg.num_splits // (box_heads or 1)
    num_ctas = max(1, min(cfg.num_ctas, num_units))
    items, counts = _schedule(work, Hkv, cfg.num_splits, num_ctas, bk, box_heads)
    item_rows = _item_rows(items, work, page_indices, num_kv_heads=Hkv,
                           num_splits=cfg.num_splits, block_kv=bk, page_size=page_size,
                           sliding_window=sliding_window)
    args = [item_rows, counts, page_indices, q_tiles, k_pages, v_pages]
    if sinks_rows is not None:
        args.append(sinks_rows)
    results = plgpu.kernel(
        entry, out_type=out_type, grid=(num_ctas,), grid_names=("cta",),
        num_threads=wgs + 1 + upcaster, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(*args)
    if box_heads:  # padding tokens' items stored zeros
        return results[0].reshape(T, Hq, D)
    # Padding tokens (no CTA computes them) come back as 0, like the reference.
    out = _gather_rows(results[0], results[1] if split else None, rows, sinks)
    return out.astype(q.dtype)


def unsupported_reason(q, k_pages) -> str | None:
    """Why this kernel cannot take these inputs (None if it can)."""
    _, Hq, D = q.shape
    _, page_size, Hkv, _ = k_pages.shape
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"q dtype {q.dtype}: needs bfloat16 or float16"
    if k_pages.dtype not in (q.dtype, FP8_KV_DTYPE):
        return f"KV pages {k_pages.dtype} with q {q.dtype}"
    if D % 64 or D > 256 or page_size % 8 or Hq // Hkv > ROWS:
        return (f"head_dim {D} (multiple of 64, <= 256), page_size {page_size} (multiple "
                f"of 8), {Hq // Hkv} query heads per KV head (<= {ROWS}) required")
    return None
