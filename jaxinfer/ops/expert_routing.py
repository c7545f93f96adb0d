"""Expert routing for the MoE block: each token's top k experts, and the (token, expert)
pairs laid out as the rows of the grouped matmuls.

    top_k_experts(logits [T, E], k) -> (top_logits [T, k], experts [T, k] int32)
        the k largest logits of each token, largest first; of equal logits the lower
        expert first (as `jax.lax.top_k`)

    expert_rows(local [P], num_local, tokens) -> (order [R], pair_row [P], ExpertRows)
        local: each pair's expert on this device (pairs token-major, P = tokens * k;
        num_local: routed nowhere, or to another device's experts); order: the pair of
        each row (a row's input is x[order // k]); pair_row: the row of each pair (a
        pair's output is y[pair_row]); `ExpertRows`: what the grouped matmuls take

Each op has implementations in preference order (a `Registry`, `TOP_K` and `EXPERT_ROWS`),
which compute the same result in different ways; `implementation=` forces one. They are
pure JAX, with no kernel importing this module, so contract and registry share it.

  TOP_K        ranks        T * E * E <= RANK_TOP_K_MAX (decode): two compare-sums
               lax_top_k    XLA's top-k, a sort of each row
  EXPERT_ROWS  router_order one token: its k pairs in the router's order, each a group of
                            its own (its experts differ), no sort
               ranks        up to RANK_SORT_MAX_PAIRS pairs: two compare-sums, and each
                            row's group span (`RowGroups`) as a by-product
               aligned      many pairs per expert (`aligns_groups`, prefill): sorted, each
                            group padded to GROUP_ALIGN rows (`groups_aligned`)
               sort         one sort of the keys expert * P + pair
               argsort      when those keys would not fit int32
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxinfer.ops.grouped_matmul import GROUP_ALIGN, RowGroups
from jaxinfer.ops.registry import Implementation, Registry


class ExpertRows(NamedTuple):
    """The grouped matmuls' rows: group_sizes [L] int32, expert [R] int32 (each row's
    expert; L: none), groups, each row's group span (`RowGroups`) where the layout gives it
    (decode steps), else None, whether the rows are sorted by expert, and whether each
    group's size is a multiple of GROUP_ALIGN rows (the aligned layout; both static)."""
    group_sizes: jax.Array
    expert: jax.Array
    groups: RowGroups | None
    sorted: bool = True
    aligned: bool = False


# --- top k -------------------------------------------------------------------------------

# Up to this many compares (T x E x E) the top k come from ranks.
RANK_TOP_K_MAX = 1 << 18


class TopKCall(NamedTuple):
    tokens: int
    experts: int
    k: int


def top_k_by_ranks(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Each expert's rank (how many experts come before it) as one compare-sum over
    [T, E, E], then the k first by rank as one more. For few tokens (decode): XLA's top-k
    sorts each row, a kernel of ~3.5 us at one token, and these two take about 1 us each
    (bench/NOTES.md, MoE end to end: Norm folded into the router; softmax over the k as
    elementwise ops)."""
    E = logits.shape[1]
    other, this = logits[:, None, :], logits[:, :, None]  # [T, e, e']
    ids = jnp.arange(E)
    before = (other > this) | ((other == this) & (ids[None, None, :] < ids[None, :, None]))
    rank = jnp.sum(before, axis=2, dtype=jnp.int32)  # [T, E]
    slot = rank[:, None, :] == jnp.arange(k)[None, :, None]  # [T, k, E]
    experts = jnp.sum(jnp.where(slot, ids, 0), axis=2, dtype=jnp.int32)
    top_logits = jnp.sum(jnp.where(slot, logits[:, None, :], 0.0), axis=2)
    return top_logits, experts


def _ranks_top_k_supports(call: TopKCall) -> str | None:
    compares = call.tokens * call.experts * call.experts
    if compares > RANK_TOP_K_MAX:
        return (f"{compares} compares (T x E x E): more than RANK_TOP_K_MAX "
                f"({RANK_TOP_K_MAX}), where XLA's top-k is faster")
    return None


# Every implementation of both ops is `batch_invariant`: they select and lay out, with no
# arithmetic a row's numbers could take in another order (batch-invariant mode).
TOP_K = Registry("top_k_experts", [
    Implementation("ranks", top_k_by_ranks, _ranks_top_k_supports, batch_invariant=True),
    Implementation("lax_top_k", jax.lax.top_k, lambda call: None, batch_invariant=True),
])


def top_k_experts(logits: jax.Array, k: int, *,
                  implementation: str | None = None) -> tuple[jax.Array, jax.Array]:
    """logits [T, E] -> (top_logits [T, k], experts [T, k] int32) (see the module
    docstring). `implementation` forces one of TOP_K.names."""
    tokens, experts = logits.shape
    return TOP_K.pick(TopKCall(tokens, experts, k), implementation).fn(logits, k)


# --- the rows of the grouped matmuls -----------------------------------------------------

# Up to this many pairs the sort is two compare-sums over [P, P] (`sort_by_ranks`).
RANK_SORT_MAX_PAIRS = 1024
# The aligned layout's static rows exceed the pairs by up to (GROUP_ALIGN - 1) per group;
# it is taken where that is at most a quarter of them (see `aligns_groups`).
ALIGN_MIN_PAIRS_PER_GROUP = 4 * (GROUP_ALIGN - 1)


class RowsCall(NamedTuple):
    tokens: int
    pairs: int
    num_local: int

    @property
    def keys_fit(self) -> bool:
        """Whether the sort keys expert * P + pair (expert up to num_local) fit int32."""
        return (self.num_local + 1) * self.pairs < 2 ** 31


def aligns_groups(pairs: int, num_local: int) -> bool:
    """Whether a step of `pairs` (token, expert) pairs over `num_local` experts takes the
    aligned layout (`align_groups`): beyond the rank sort's sizes, and with
    pairs >= ALIGN_MIN_PAIRS_PER_GROUP per expert, so that its static padding (up to 7 rows
    an expert, also gathered, activated and zeroed) stays under 25% of the rows. Qwen3-30B-
    A3B (128 experts, top-8): from 448 tokens; Mixtral (8, top-2): from 513 tokens."""
    return pairs > RANK_SORT_MAX_PAIRS and pairs >= ALIGN_MIN_PAIRS_PER_GROUP * num_local


def in_router_order(local: jax.Array, num_local: int, group_sizes: jax.Array):
    """One token's pairs: its k experts differ, so each pair is a group of one row, and the
    rows stay in the router's order (the grouped matmul takes groups in any order): no
    sort, whose two kernels a layer go."""
    del num_local
    order = jnp.arange(local.shape[0], dtype=jnp.int32)
    return order, order, ExpertRows(group_sizes, local, RowGroups(local, order, order + 1),
                                    sorted=False)


def sort_by_ranks(local: jax.Array, num_local: int, group_sizes: jax.Array):
    """The pairs sorted by expert, then pair (the keys expert * P + pair are unique, so the
    order is stable): a pair's row is the number of keys below its own (and its group's
    span the number of experts below / not above its own), and each row's pair, expert
    and span are compare-sums against those rows: two kernels, where the sort, its key
    and index kernels, the scatter that inverted it and the grouped matmul's table were
    six (decode steps)."""
    del num_local
    pairs = local.shape[0]
    ids = jnp.arange(pairs, dtype=jnp.int32)
    keys = local * pairs + ids

    def count(below):  # [P, P] -> [P]: per row, how many columns hold
        return jnp.sum(below, axis=1, dtype=jnp.int32)
    pair_row = count(keys[None, :] < keys[:, None])
    start = count(local[None, :] < local[:, None])  # each pair's group span
    end = count(local[None, :] <= local[:, None])
    at_row = pair_row[None, :] == ids[:, None]  # [row, pair]
    order, sorted_local, row_start, row_end = (
        jnp.sum(jnp.where(at_row, v[None, :], 0), axis=1, dtype=jnp.int32)
        for v in (ids, local, start, end))
    return order, pair_row, ExpertRows(group_sizes, sorted_local,
                                       RowGroups(sorted_local, row_start, row_end))


def _sort_keys(local: jax.Array):
    """One sort of the keys expert * P + pair (an argsort would sort two operands, and XLA
    first copies the ids it sorts in place, a kernel of its own), and a scatter inverts
    it -> (order, sorted_local, pair_row)."""
    pairs = local.shape[0]
    ids = jnp.arange(pairs, dtype=jnp.int32)
    keys = jnp.sort(local * pairs + ids)
    order, sorted_local = keys % pairs, keys // pairs
    pair_row = jnp.zeros((pairs,), jnp.int32).at[order].set(ids, unique_indices=True)
    return order, sorted_local, pair_row


def sort_by_keys(local: jax.Array, num_local: int, group_sizes: jax.Array):
    """The pairs sorted by expert, then pair, by one sort (`_sort_keys`)."""
    del num_local
    order, sorted_local, pair_row = _sort_keys(local)
    return order, pair_row, ExpertRows(group_sizes, sorted_local, None)


def sort_by_argsort(local: jax.Array, num_local: int, group_sizes: jax.Array):
    """The pairs sorted by expert, then pair, by a stable argsort (keys too large for
    int32)."""
    del num_local
    pairs = local.shape[0]
    ids = jnp.arange(pairs, dtype=jnp.int32)
    order = jnp.argsort(local, stable=True)
    sorted_local = local[order]
    pair_row = jnp.zeros((pairs,), jnp.int32).at[order].set(ids, unique_indices=True)
    return order, pair_row, ExpertRows(group_sizes, sorted_local, None)


def align_groups(local: jax.Array, num_local: int, group_sizes: jax.Array):
    """The pairs sorted (`_sort_keys`), then spread so that every group starts on a
    multiple of GROUP_ALIGN rows: each group's size is rounded up, and the pad rows after a
    group's own rows are computed like them and never read (vLLM pads its MoE groups to a
    block the same way).

    Why: the Mosaic grouped matmul then stores its output tiles in whole 8-row tiles
    through a swizzled shared buffer (`groups_aligned`): Qwen3-30B-A3B's down projection at
    4096 tokens went from 237 to 203 us (H200, bench/NOTES.md, Grouped matmul (Mosaic GPU): Whole
    8-row output tiles at prefill). The
    layout costs at most GROUP_ALIGN - 1 rows a group (2.7% there) and no extra kernel:
    the row gathers only take other indices.

    The layout has R = P + (GROUP_ALIGN - 1) * min(L, P) rows (rounded up to GROUP_ALIGN).
    A pad row holds pair 0 and expert L; the rows routed nowhere stay last, past every
    group.
    """
    _, _, pair_row = _sort_keys(local)
    pairs = pair_row.shape[0]
    padded = (group_sizes + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    # How far each group's rows move: the padded sizes before it minus the sizes before it
    # (group L, routed nowhere, moves by all the padding).
    shift = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(padded - group_sizes)])
    rows = -(-(pairs + (GROUP_ALIGN - 1) * min(num_local, pairs)) // GROUP_ALIGN) * GROUP_ALIGN
    pair_row = pair_row + shift[local]
    aligned_order = jnp.zeros((rows,), jnp.int32).at[pair_row].set(
        jnp.arange(pairs, dtype=jnp.int32), unique_indices=True)
    aligned_local = jnp.full((rows,), num_local, jnp.int32).at[pair_row].set(
        local, unique_indices=True)
    return aligned_order, pair_row, ExpertRows(padded, aligned_local, None, aligned=True)


def _keys_reason(call: RowsCall) -> str | None:
    if not call.keys_fit:
        return (f"keys expert * P + pair up to {(call.num_local + 1) * call.pairs}: more "
                "than int32 holds")
    return None


def _router_order_supports(call: RowsCall) -> str | None:
    if call.tokens != 1:
        return (f"{call.tokens} tokens: their pairs may share an expert, whose rows a sorted "
                "layout reads its weights for once")
    return None


def _ranks_supports(call: RowsCall) -> str | None:
    if call.pairs > RANK_SORT_MAX_PAIRS:
        return (f"{call.pairs} pairs: more than RANK_SORT_MAX_PAIRS ({RANK_SORT_MAX_PAIRS}), "
                "where one sort is faster")
    return _keys_reason(call)


def _aligned_supports(call: RowsCall) -> str | None:
    if not aligns_groups(call.pairs, call.num_local):
        return (f"{call.pairs} pairs over {call.num_local} experts: the rank sort's sizes, "
                f"or fewer than ALIGN_MIN_PAIRS_PER_GROUP ({ALIGN_MIN_PAIRS_PER_GROUP}) an "
                "expert")
    return _keys_reason(call)


EXPERT_ROWS = Registry("expert_rows", [
    Implementation("router_order", in_router_order, _router_order_supports,
                   batch_invariant=True),
    Implementation("ranks", sort_by_ranks, _ranks_supports, batch_invariant=True),
    Implementation("aligned", align_groups, _aligned_supports, batch_invariant=True),
    Implementation("sort", sort_by_keys, _keys_reason, batch_invariant=True),
    Implementation("argsort", sort_by_argsort, lambda call: None, batch_invariant=True),
])


def expert_rows(local: jax.Array, num_local: int, tokens: int, *,
                implementation: str | None = None):
    """local [P] int32 -> (order [R], pair_row [P], ExpertRows) (see the module
    docstring). `implementation` forces one of EXPERT_ROWS.names."""
    # Counts as a compare-and-sum (fuses with its neighbours; a scatter-add would not).
    group_sizes = jnp.sum(local[:, None] == jnp.arange(num_local)[None, :], axis=0,
                          dtype=jnp.int32)
    call = RowsCall(tokens, local.shape[0], num_local)
    return EXPERT_ROWS.pick(call, implementation).fn(local, num_local, group_sizes)
