"""Expert routing (`jaxinfer.ops.expert_routing`): every implementation of each op against
numpy (the top k of each token's logits; the pairs' row layouts, with pairs routed nowhere),
and the registries' picks."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from jaxinfer.ops.expert_routing import (
    ALIGN_MIN_PAIRS_PER_GROUP,
    EXPERT_ROWS,
    RANK_SORT_MAX_PAIRS,
    TOP_K,
    RowsCall,
    TopKCall,
    aligns_groups,
    expert_rows,
    top_k_experts,
)
from jaxinfer.ops.grouped_matmul import GROUP_ALIGN


@pytest.mark.parametrize("implementation", TOP_K.names)
@pytest.mark.parametrize("shape,k", [((5, 8), 3), ((16, 128), 8)])
def test_top_k_matches_numpy(implementation, shape, k):
    """On random logits and on small integers (many ties: the lower expert first)."""
    key = jax.random.key(np.random.randint(1 << 30))
    fn = jax.jit(functools.partial(top_k_experts, k=k, implementation=implementation))
    for logits in (jax.random.normal(key, shape),
                   jax.random.randint(key, shape, -2, 3).astype(np.float32)):
        top_logits, experts = map(np.asarray, fn(logits))
        x = np.asarray(logits)
        want = np.argsort(-x, axis=1, kind="stable")[:, :k]
        np.testing.assert_array_equal(experts, want)
        assert experts.dtype == np.int32
        np.testing.assert_array_equal(top_logits, np.take_along_axis(x, want, 1))


@pytest.mark.parametrize("call,want", [
    (TopKCall(1, 128, 8), "ranks"),  # decode
    (TopKCall(16, 128, 8), "ranks"),  # 16 * 128 * 128: RANK_TOP_K_MAX
    (TopKCall(17, 128, 8), "lax_top_k"),
    (TopKCall(4097, 8, 2), "lax_top_k"),
])
def test_top_k_picks(call, want):
    assert TOP_K.pick(call).name == want, TOP_K.reasons(call)
    if want != "ranks":
        assert "RANK_TOP_K_MAX" in TOP_K.reasons(call)["ranks"]


@pytest.mark.parametrize("implementation", EXPERT_ROWS.names)
def test_expert_rows_match_numpy(implementation):
    """Each layout, forced, on pairs with some routed nowhere (expert L): every pair's row
    holds it; the group sizes count each expert's pairs (rounded up to GROUP_ALIGN where
    aligned); sorted layouts hold each group's pairs in pair order from the group's start
    (pad rows: expert L); the groups' spans, where given, cover each row's group."""
    rng = np.random.default_rng(np.random.randint(1 << 30))
    for pairs, num_local in [(8, 128), (96, 16), (40, 3), (300, 128)]:
        local = rng.integers(0, num_local + 1, pairs).astype(np.int32)
        fn = jax.jit(functools.partial(expert_rows, num_local=num_local, tokens=pairs,
                                       implementation=implementation))
        order, pair_row, rows = fn(local)
        order, pair_row, expert, sizes = (np.asarray(a) for a in (
            order, pair_row, rows.expert, rows.group_sizes))
        counts = np.bincount(local, minlength=num_local + 1)
        np.testing.assert_array_equal(order[pair_row], np.arange(pairs))
        np.testing.assert_array_equal(expert[pair_row], local)
        pads = np.setdiff1d(np.arange(order.shape[0]), pair_row)
        assert (expert[pads] == num_local).all()
        if rows.aligned:
            assert rows.sorted and rows.groups is None
            assert (sizes % GROUP_ALIGN == 0).all() and order.shape[0] % GROUP_ALIGN == 0
            assert (sizes >= counts[:-1]).all() and (sizes < counts[:-1] + GROUP_ALIGN).all()
            assert order.shape[0] >= sizes.sum() + counts[-1]
        else:
            np.testing.assert_array_equal(sizes, counts[:-1])
            assert order.shape[0] == pairs and pads.size == 0
        starts = np.concatenate([[0], np.cumsum(sizes)])
        if rows.sorted:
            want_row = np.empty(pairs, np.int64)
            for g in range(num_local + 1):  # each group's pairs, in pair order
                mine = np.flatnonzero(local == g)
                want_row[mine] = starts[g] + np.arange(mine.size)
            np.testing.assert_array_equal(pair_row, want_row)
        if rows.groups is not None:
            group, start, end = (np.asarray(a) for a in rows.groups)
            np.testing.assert_array_equal(group, expert)
            r = np.arange(order.shape[0])
            if rows.sorted:  # each group one span: its rows
                np.testing.assert_array_equal(start, starts[group])
                np.testing.assert_array_equal(end, starts[group] + counts[group])
            else:  # each row its own span
                np.testing.assert_array_equal(start, r)
                np.testing.assert_array_equal(end, r + 1)


@pytest.mark.parametrize("call,want", [
    (RowsCall(1, 8, 128), "router_order"),  # one token (Qwen3's top 8)
    (RowsCall(1, 2, 8), "router_order"),
    (RowsCall(2, 16, 128), "ranks"),
    (RowsCall(128, RANK_SORT_MAX_PAIRS, 128), "ranks"),
    # From 28 pairs an expert (padding <= 25%), beyond the rank sort's sizes: aligned.
    (RowsCall(448, 3584, 128), "aligned"),
    (RowsCall(447, 3576, 128), "sort"),
    (RowsCall(513, 1026, 8), "aligned"),
    (RowsCall(200, 1600, 128), "sort"),
    # Keys expert * P + pair past int32.
    (RowsCall(1 << 20, 1 << 24, 128), "argsort"),
])
def test_expert_rows_picks(call, want):
    reasons = EXPERT_ROWS.reasons(call)
    assert EXPERT_ROWS.pick(call).name == want, reasons
    for name in EXPERT_ROWS.names[:EXPERT_ROWS.names.index(want)]:
        assert reasons[name], name


def test_aligns_groups_threshold():
    assert ALIGN_MIN_PAIRS_PER_GROUP == 4 * (GROUP_ALIGN - 1)
    assert aligns_groups(3584, 128) and not aligns_groups(3576, 128)
    assert aligns_groups(1026, 8) and not aligns_groups(1024, 8)
