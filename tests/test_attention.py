"""Every implementation the attention registry lists against an independent float64 oracle,
and the registry's choice between them.

The cases and the oracle live in attention_cases.py. The reference runs every
case in float32 and bf16; the kernels (bf16 / fp16 queries only: they run on
tensor cores) run every case with bf16 queries, in interpret mode on the CPU and
natively under `pytest -m gpu`.
"""

from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import CASES, Case, build, expected_pages, oracle
from jax.experimental import pallas as pl

import jaxinfer.ops.attention_by_sequence as attention_by_sequence
import jaxinfer.ops.attention_registry as attention_registry
import jaxinfer.ops.platform as platform_module
from jaxinfer.mosaic import ragged_paged_attention as mosaic
from jaxinfer.ops.attention import (
    FP8_KV_DTYPE,
    AttentionCall,
    AttentionMetadata,
    quantize_kv,
    write_kv_pages,
)
from jaxinfer.ops.attention_registry import REGISTRY, ragged_paged_attention
from jaxinfer.ops.rope import QKPrologue, RowNorm, inverse_rms, rope_tables
from jaxinfer.pallas_kernels import kv_write_gpu
from jaxinfer.pallas_kernels import ragged_paged_attention_gpu as pallas_gpu_kernel


def run(case: Case, b, implementation: str = "reference", prologue=None, fused=False,
        zero_tails=True):
    """The case through `ragged_paged_attention`; fused: q, k, v as one projection
    [T, (Hq + 2 Hkv) * D] (k = v = None); zero_tails: the metadata's."""
    fn = jax.jit(functools.partial(
        ragged_paged_attention, sm_scale=case.d ** -0.5, sliding_window=case.sliding_window,
        soft_cap=case.soft_cap, k_scale=case.k_scale, v_scale=case.v_scale,
        implementation=implementation))
    md = AttentionMetadata(**{n: jnp.asarray(x) for n, x in b["md"].items()},
                           zero_tails=zero_tails)
    dt = jnp.dtype(case.dtype)
    kv_dt = jnp.dtype(case.kv_dtype or case.dtype)
    sinks = None if b["sinks"] is None else jnp.asarray(b["sinks"])
    q, k, v = (jnp.asarray(b[n], dt) for n in ("q", "k", "v"))
    if fused:
        q, k, v = jnp.concatenate([x.reshape(x.shape[0], -1) for x in (q, k, v)], 1), None, None
    out, kp, vp = fn(q, k, v, jnp.asarray(b["k_pages"], kv_dt),
                     jnp.asarray(b["v_pages"], kv_dt), md, sinks=sinks, prologue=prologue)
    assert out.dtype == dt and kp.dtype == kv_dt and vp.dtype == kv_dt
    assert out.shape == b["q"].shape
    assert kp.shape == b["k_pages"].shape and vp.shape == b["v_pages"].shape
    return (np.asarray(out.astype(jnp.float32)), np.asarray(kp.astype(jnp.float32)),
            np.asarray(vp.astype(jnp.float32)))


gpu = pytest.mark.gpu
# (implementation, platform): every implementation the registry lists on the CPU (kernels in
# interpret mode), and natively on the GPU under `-m gpu`, except the TPU kernel (which
# would only run interpreted there too).
BACKENDS = [backend for name in REGISTRY.names for backend in (
    (name, "cpu"), *([] if name == "pallas_tpu" else [pytest.param(name, "gpu", marks=gpu)]))]


# The implementations in XLA (every dtype); the kernels run on tensor cores (bf16 / fp16 q).
XLA_IMPLEMENTATIONS = ("by_sequence", "by_sequence_fixed_rows", "reference")


def check_against_oracle(case: Case, implementation: str, platform: str, zero_tails=True):
    """The case against the oracle (live outputs, pages); returns (out, the built case)."""
    if implementation not in XLA_IMPLEMENTATIONS and case.dtype == "float32":
        case = dataclasses.replace(case, dtype="bfloat16")
    b = build(case)
    # Full float32 matmuls on GPUs too (their default is TF32 for float32 dots).
    with jax.default_device(jax.devices(platform)[0]), jax.default_matmul_precision("highest"):
        out, kp, vp = run(case, b, implementation, zero_tails=zero_tails)
    live = out[:b["live_tokens"]]

    # (c) no NaN / inf in live outputs, whatever the pages held.
    bad = np.argwhere(~np.isfinite(live))[:5]
    assert np.isfinite(live).all(), f"non-finite live outputs at {bad}"

    # (a) live outputs match the float64 oracle.
    want = oracle(case, b)
    tol = 1e-5 if case.dtype == "float32" else 2e-2
    np.testing.assert_allclose(live, want, rtol=tol, atol=tol)

    # (b) new k/v at the right (page, slot); every other slot unchanged.
    k_exp, v_exp, written = expected_pages(case, b, zero_tails)
    assert written.sum() == b["live_tokens"]
    np.testing.assert_array_equal(kp, k_exp.astype(np.float32))
    np.testing.assert_array_equal(vp, v_exp.astype(np.float32))
    # And the write really changed the slots (k/v differ from the old page contents).
    assert not np.array_equal(kp[written], b["k_pages"][written])
    assert not np.array_equal(vp[written], b["v_pages"][written])
    return out, b


@pytest.mark.parametrize("implementation,platform", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_oracle(name, implementation, platform):
    check_against_oracle(CASES[name], implementation, platform)


@pytest.mark.parametrize("implementation,platform", BACKENDS)
@pytest.mark.parametrize("name", ["poison", "poison_window_sinks", "fp8_kv"])
def test_finite_pages_need_no_tail_zeroing(name, implementation, platform):
    """Without the tail zeroing (md.zero_tails False: the runner's steps, whose pages hold
    finite values only), every implementation matches the oracle over pages whose other
    slots hold finite garbage (+-1e30 in the poison cases, past kv_len in last pages
    too), and the write changes no slot but this step's."""
    check_against_oracle(CASES[name], implementation, platform, zero_tails=False)


@pytest.mark.parametrize("row_block", [1, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_by_sequence_row_blocks_match_oracle(name, row_block, monkeypatch):
    """The XLA implementation with other query row blocks than its programs' (1 row; 3 rows,
    whose blocks straddle sequences and the batch's end), against the oracle."""
    monkeypatch.setattr(attention_by_sequence, "ROW_BLOCK", row_block)
    check_against_oracle(CASES[name], "by_sequence", "cpu")


def test_oracle_sees_history_and_masking():
    """Sanity of the harness itself: perturbing visible history changes the output,
    perturbing pages owned by nobody does not."""
    case = CASES["mixed"]
    b = build(case)
    out, _, _ = run(case, b)

    b2 = build(case)
    b2["k_pages"][b2["unowned"]] = 123.0
    b2["v_pages"][b2["unowned"]] = -77.0
    out2, kp2, _ = run(case, b2)
    np.testing.assert_array_equal(out2[:b["live_tokens"]], out[:b["live_tokens"]])
    np.testing.assert_array_equal(kp2[b2["unowned"]], 123.0)

    # Change one history key of sequence 0 (a prefill chunk on top of 18 cached tokens).
    b3 = build(case)
    pi = b3["md"]["page_indices"]
    b3["k_pages"][pi[0, 0], 3] += 1.0
    b3["hist_k"][0][3] += 1.0
    out3, _, _ = run(case, b3)
    q0 = case.seqs[0][0]
    assert not np.allclose(out3[:q0], out[:q0])
    np.testing.assert_allclose(out3[:b3["live_tokens"]], oracle(case, b3), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out3[q0:b["live_tokens"]], out[q0:b["live_tokens"]])


def test_num_seqs_is_dynamic():
    """One compiled function; lowering num_seqs turns the last live sequence into padding."""
    case = CASES["mixed"]
    b = build(case)
    fn = jax.jit(functools.partial(ragged_paged_attention, sm_scale=case.d ** -0.5))
    args = [jnp.asarray(b[n]) for n in ("q", "k", "v", "k_pages", "v_pages")]

    def call(n):
        md = dict(b["md"], num_seqs=np.array([n], np.int32))
        return [np.asarray(x) for x in
                fn(*args, AttentionMetadata(**{k: jnp.asarray(x) for k, x in md.items()}))]

    out_all, kp_all, _ = call(len(case.seqs))
    out_less, kp_less, _ = call(len(case.seqs) - 1)
    assert fn._cache_size() == 1
    n_tok = b["live_tokens"] - case.seqs[-1][0]
    np.testing.assert_array_equal(out_less[:n_tok], out_all[:n_tok])
    # The dropped sequence's tokens were not written.
    q_last, kv_last = case.seqs[-1]
    pi = b["md"]["page_indices"][len(case.seqs) - 1]
    for i in range(q_last):
        pos = kv_last - q_last + i
        page, slot = pi[pos // case.page_size], pos % case.page_size
        np.testing.assert_array_equal(kp_less[page, slot], b["k_pages"][page, slot])
        np.testing.assert_array_equal(kp_all[page, slot], b["k"][n_tok + i])


MOSAIC_CONFIGS = {  # (block_kv, num_stages, compute_wgs, num_splits, tile_rows, num_ctas)
    "decode_split3": (64, 2, 1, 3),
    "tile8_split2": (64, 3, 1, 2, 8),
    "one_wg_deep": (64, 4, 1, 1),
    "two_wg_split2": (64, 2, 2, 2),
    # Few persistent CTAs: each runs several items, its KV ring running on across them.
    "two_ctas": (64, 3, 1, 1, 64, 2),
    "three_ctas_tile8_split2": (64, 2, 1, 2, 8, 3),
    "one_cta_two_wg": (64, 2, 2, 1, 64, 1),
}


@pytest.mark.parametrize("platform", ["cpu", pytest.param("gpu", marks=gpu)])
@pytest.mark.parametrize("config", list(MOSAIC_CONFIGS))
@pytest.mark.parametrize("name", ["mixed", "window_cap_sinks", "poison_nan", "fp8_kv",
                                  "gqa3_d64"])
def test_mosaic_configs(name, config, platform):
    """The Mosaic kernel's other configurations (split-KV and its combine, deeper rings,
    smaller KV blocks) against the oracle; the kernel's heuristic picks only one."""
    cfg = mosaic.Config(*MOSAIC_CONFIGS[config])
    orig = mosaic.choose_config
    mosaic.choose_config = lambda *a, **k: cfg
    try:
        check_against_oracle(CASES[name], "mosaic_gpu", platform)
    finally:
        mosaic.choose_config = orig


@pytest.mark.parametrize("platform", ["cpu", pytest.param("gpu", marks=gpu)])
@pytest.mark.parametrize("config", ["tile8_split2", "one_cta_two_wg"])
def test_mosaic_dead_query_rows_stay_in_their_rows(config, platform, monkeypatch):
    """The query tiles' rows that no token fills hold whatever their memory held; with
    NaN there, the live outputs still match the oracle (each query row is its own wgmma
    row and softmax, and the output gather reads live rows only)."""
    def nan_filled(shape, dtype):
        return jnp.full(shape, jnp.nan, dtype)

    monkeypatch.setattr(mosaic, "_uninitialized", nan_filled)
    monkeypatch.setattr(mosaic, "choose_config",
                        lambda *a, **k: mosaic.Config(*MOSAIC_CONFIGS[config]))
    mosaic.attend_pages_mgpu.clear_cache()  # traced before with the uninitialized buffer
    try:
        check_against_oracle(CASES["mixed"], "mosaic_gpu", platform)
    finally:
        mosaic.attend_pages_mgpu.clear_cache()


# Decode steps (at most one token per sequence slot), whose query rows the Mosaic kernel
# reads from q itself (`Config.queries_in_place`), with whether its output goes through
# XLA's gather (KV splits) or straight into out, a box of 8 rows at a time.
IN_PLACE_CASES = {
    # G = 4 in boxes of 8 rows: the second KV head's rows start mid-box, at row 4; a long
    # context, so the KV splits and their merge run too.
    "decode_gqa4_split": (Case(seqs=((1, 5), (1, 1100), (1, 3), (1, 20), (1, 16)), hq=8,
                               hkv=2, dtype="bfloat16", pad_tokens=1), "gather"),
    # G = 8 (a box per KV head); a sequence of three tokens (an entry each, causal between
    # them); window, soft cap and sinks.
    "decode_gqa8_three_tokens": (Case(seqs=((3, 20), (1, 7), (1, 33)), hq=16, hkv=2,
                                      dtype="bfloat16", pad_seqs=3, pad_tokens=1,
                                      sliding_window=9, soft_cap=2.0, q_scale=4.0,
                                      sinks=True), "boxes"),
    # G = 4, no splits: two KV heads fill a box, the second adding its rows to the
    # first's; padding tokens store zero boxes.
    "decode_gqa4_boxes": (Case(seqs=((1, 5), (1, 70), (1, 3), (1, 20), (1, 16)), hq=8,
                               hkv=2, dtype="bfloat16", pad_seqs=2, pad_tokens=2), "boxes"),
    # G = 2: four KV heads a box, with sinks.
    "decode_gqa2_boxes": (Case(seqs=((1, 9), (1, 33), (1, 64)), hq=8, hkv=4,
                               dtype="bfloat16", pad_seqs=2, pad_tokens=1, sinks=True),
                          "boxes"),
    # fp8 pages (q read in f16, the upcast warpgroup), scaled, in boxes and with splits.
    "decode_gqa4_fp8_boxes": (Case(seqs=((1, 9), (1, 150), (1, 33)), hq=8, hkv=2,
                                   dtype="bfloat16", kv_dtype="float8_e4m3fn", pad_seqs=2,
                                   pad_tokens=1, k_scale=2.0**-6, v_scale=2.0**-5), "boxes"),
    "decode_gqa4_fp8_split": (Case(seqs=((1, 9), (1, 1100), (1, 33)), hq=8, hkv=2,
                                   dtype="bfloat16", kv_dtype="float8_e4m3fn", pad_seqs=2,
                                   pad_tokens=1, k_scale=2.0**-6, v_scale=2.0**-5), "gather"),
}


@pytest.mark.parametrize("platform", ["cpu", pytest.param("gpu", marks=gpu)])
@pytest.mark.parametrize("name", list(IN_PLACE_CASES))
def test_mosaic_queries_in_place(name, platform, monkeypatch):
    """A decode step's query rows read straight from q (a KV head's G rows at row
    (h G) % 8 of an 8-row box), no query tiles: against the oracle, and padding tokens'
    rows 0 (interpret mode fills outputs with NaN first, so an unwritten row fails)."""
    case, path = IN_PLACE_CASES[name]
    calls = {"_tile_queries": 0, "_gather_rows": 0}

    def counted(fn_name):
        fn = getattr(mosaic, fn_name)

        def call(*args):
            calls[fn_name] += 1
            return fn(*args)
        return call

    for fn_name in calls:
        monkeypatch.setattr(mosaic, fn_name, counted(fn_name))
    mosaic.attend_pages_mgpu.clear_cache()
    try:
        out, b = check_against_oracle(case, "mosaic_gpu", platform)
    finally:
        mosaic.attend_pages_mgpu.clear_cache()
    assert calls["_tile_queries"] == 0, "the step took the query tiles"
    assert calls["_gather_rows"] == (path == "gather"), calls
    np.testing.assert_array_equal(out[b["live_tokens"]:], 0)


def test_mosaic_box_schedule_keeps_a_box_on_one_cta():
    """`_schedule` with box_heads: a box's KV heads are consecutive items of one CTA's list,
    in head order, and every token's items are live (padding tokens store zeros)."""
    hkv, heads = 8, 2
    tokens = np.array([1] * 37 + [0] * 3)  # 37 live decode tokens, 3 padding
    kv_len = np.random.default_rng(1).integers(1, 900, tokens.size)
    work = np.zeros((tokens.size, 8), np.int32)
    work[:, 2], work[:, 3], work[:, 4] = tokens, kv_len - 1, kv_len
    items, counts = mosaic._schedule(jnp.asarray(work), hkv, 1, 13, 64, box_heads=heads)
    items, counts = np.asarray(items), np.asarray(counts)
    assert counts.sum() == tokens.size * hkv
    seen = []
    for row, n in zip(items, counts, strict=True):
        assert (row[n:] == -1).all() and (row[:n] >= 0).all()
        pairs = row[:n].reshape(-1, heads)
        assert (pairs[:, 0] % heads == 0).all() and (np.diff(pairs, axis=1) == 1).all()
        seen += row[:n].tolist()
    assert sorted(seen) == list(range(tokens.size * hkv))


def test_mosaic_queries_in_place_only_where_the_step_allows():
    """One consumer, at most a token a sequence slot, boxes holding whole KV heads within a
    token; anything else keeps the tiles (and a config asking for it says why)."""
    decode = mosaic.choose_config(256, 256, 8, 4096, 128, 4)
    assert mosaic.queries_in_place_reason(decode, 256, 256, 32, 4) is None
    assert "tokens over" in mosaic.queries_in_place_reason(decode, 257, 256, 32, 4)
    assert "tile_rows" in mosaic.queries_in_place_reason(decode, 4, 4, 28, 7)  # G = 7
    assert "warpgroups" in mosaic.queries_in_place_reason(
        mosaic.choose_config(2048, 256, 8, 4096, 128, 4), 256, 256, 32, 4)
    case = CASES["mixed"]  # 25 tokens over 7 sequence slots
    b = build(dataclasses.replace(case, dtype="bfloat16"))
    md = AttentionMetadata(**{n: jnp.asarray(x) for n, x in b["md"].items()})
    with pytest.raises(ValueError, match="queries_in_place: 25 tokens over 7"):
        mosaic.attend_pages_mgpu(
            jnp.asarray(b["q"], jnp.bfloat16), jnp.asarray(b["k_pages"], jnp.bfloat16),
            jnp.asarray(b["v_pages"], jnp.bfloat16), md, sm_scale=0.125,
            config=mosaic.Config(compute_wgs=1, tile_rows=8, queries_in_place=True))


# (block_kv, num_splits) of the Pallas GPU kernel: one split (out written by the kernel)
# and several (merged by its second kernel), blocks smaller and larger than a page.
PALLAS_GPU_CONFIGS = {"one_split": (16, 1), "one_split_bk64": (64, 1), "split3": (32, 3),
                      "split7_bk16": (16, 7)}


@pytest.mark.parametrize("platform", ["cpu", pytest.param("gpu", marks=gpu)])
@pytest.mark.parametrize("config", list(PALLAS_GPU_CONFIGS))
@pytest.mark.parametrize("name", ["mixed", "window_cap_sinks", "poison_nan", "fp8_kv",
                                  "gqa3_d64", "page_size_8", "single_token"])
def test_pallas_gpu_configs(name, config, platform):
    """The Pallas GPU kernel's block sizes and split counts against the oracle (the
    wrapper's heuristic picks only one per shape)."""
    kernel = pallas_gpu_kernel
    block_kv, num_splits = PALLAS_GPU_CONFIGS[config]
    orig = kernel.attend_pages_gpu
    kernel.attend_pages_gpu = lambda *a, **kw: orig(*a, **{**kw, "block_kv": block_kv,
                                                           "num_splits": num_splits})
    try:
        check_against_oracle(CASES[name], "pallas_gpu", platform)
    finally:
        kernel.attend_pages_gpu = orig


@pytest.mark.parametrize("config", ["one_split", "split3"])
@pytest.mark.parametrize("name", ["mixed", "window_cap_sinks", "single_token"])
def test_pallas_gpu_reads_no_row_its_step_writes(name, config, monkeypatch):
    """The Pallas GPU kernel stores this step's k/v rows while its other programs attend;
    on a GPU they run at once, so none may read one of those rows from the pages. Interpret
    mode runs the programs in turn (a later one would see an earlier store), so here the
    stores write NaN: the outputs match the oracle only if every program took this step's
    rows from the k/v inputs."""
    from types import SimpleNamespace

    kernel = pallas_gpu_kernel
    real = kernel.pl_triton

    def poisoned_store(ref, val, **kw):
        return real.store(ref, jnp.full_like(val, jnp.nan), **kw)

    monkeypatch.setattr(kernel, "pl_triton", SimpleNamespace(
        **{**{n: getattr(real, n) for n in dir(real) if not n.startswith("_")},
           "store": poisoned_store}))
    case = dataclasses.replace(CASES[name], dtype="bfloat16")
    b = build(case)
    block_kv, num_splits = PALLAS_GPU_CONFIGS[config]
    md = AttentionMetadata(**{n: jnp.asarray(x) for n, x in b["md"].items()})
    q, k, v, kp, vp = (jnp.asarray(b[n], jnp.bfloat16)
                       for n in ("q", "k", "v", "k_pages", "v_pages"))
    sinks = None if b["sinks"] is None else jnp.asarray(b["sinks"])
    kernel.attend_pages_gpu.clear_cache()  # trace afresh with the poisoned store
    try:
        out, kp, vp = jax.jit(functools.partial(
            kernel.ragged_paged_attention_gpu, sm_scale=case.d ** -0.5,
            sliding_window=case.sliding_window, soft_cap=case.soft_cap, block_kv=block_kv,
            num_splits=num_splits))(q, k, v, kp, vp, md, sinks=sinks)
    finally:
        kernel.attend_pages_gpu.clear_cache()
    live = np.asarray(out.astype(jnp.float32))[:b["live_tokens"]]
    np.testing.assert_allclose(live, oracle(case, b), rtol=2e-2, atol=2e-2)
    written = expected_pages(case, b)[2]
    assert np.isnan(np.asarray(kp.astype(jnp.float32))[written]).all()  # the stores ran
    assert np.isnan(np.asarray(vp.astype(jnp.float32))[written]).all()


def test_step_metadata_runs_no_loop():
    """Where each token and work entry sits is found without a loop: a while loop's
    condition goes back to the host on GPUs, so a step holding one could not be enqueued
    ahead of the device (jnp.searchsorted's default is such a loop). The results match a
    plain search on the host."""
    from jaxinfer.ops.attention import token_positions
    from jaxinfer.ops.grouped_matmul_registry import row_group_ids

    rng = np.random.default_rng()
    S, T = 7, 40
    q_lens = rng.integers(0, 9, S)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    md = AttentionMetadata(cu_q_lens=jnp.asarray(cu),
                           kv_lens=jnp.asarray(q_lens + rng.integers(0, 50, S), jnp.int32),
                           page_indices=jnp.zeros((S, 4), jnp.int32),
                           num_seqs=jnp.array([S - 1], jnp.int32))
    sizes = jnp.asarray(rng.integers(0, 6, 5), jnp.int32)
    programs = {
        "token_positions": (lambda md: token_positions(md, T), (md,)),
        "mosaic_work_list": (lambda md: mosaic._work_list(md, 30, 4), (md,)),
        "row_group_ids": (lambda g: row_group_ids(g, 24), (sizes,)),
    }
    for name, (fn, args) in programs.items():
        assert "stablehlo.while" not in jax.jit(fn).lower(*args).as_text(), name
    seq = np.asarray(token_positions(md, T)[0])
    live = np.arange(T) < cu[S - 1]
    want = np.minimum(np.searchsorted(cu[1:], np.arange(T), side="right"), S - 1)
    np.testing.assert_array_equal(seq[live], want[live])
    ends = np.cumsum(np.asarray(sizes))
    np.testing.assert_array_equal(np.asarray(row_group_ids(sizes, 24)),
                                  np.searchsorted(ends, np.arange(24), side="right"))


@pytest.mark.parametrize("num_ctas", [1, 3, 7, 200])
def test_mosaic_schedule_deals_every_live_item_once(num_ctas):
    """The persistent kernel's item lists: every item of an entry with tokens exactly once,
    live items first in each list, no item of an empty entry, and list costs within one
    item's cost of each other (snake order over items sorted by cost)."""
    rng = np.random.default_rng()
    entries, hkv, splits, bk = 23, 3, 2, 64
    tokens = rng.integers(0, 3, entries) * rng.integers(1, 40, entries)
    pos0 = rng.integers(0, 3000, entries)
    work = np.zeros((entries, 8), np.int32)
    work[:, 2], work[:, 3] = tokens, pos0
    num_ctas = min(num_ctas, entries * hkv * splits)
    items, counts = (np.asarray(x) for x in mosaic._schedule(jnp.asarray(work), hkv, splits,
                                                      num_ctas, bk))
    live = [i for i in range(entries * hkv * splits) if tokens[i // (hkv * splits)] > 0]
    dealt = items[items >= 0]
    assert sorted(dealt.tolist()) == live
    for c in range(num_ctas):
        assert (items[c, :counts[c]] >= 0).all() and (items[c, counts[c]:] == -1).all()
    cost = np.where(tokens > 0, (pos0 + tokens + bk - 1) // bk + 1, 0)
    per_cta = [sum(cost[i // (hkv * splits)] for i in items[c, :counts[c]])
               for c in range(num_ctas)]
    assert max(per_cta) - min(per_cta) <= cost.max()


@pytest.mark.parametrize("tokens_per_block", [1, 2, 8, 32])
def test_mosaic_work_list_fits_its_static_bound(tokens_per_block):
    """`_max_entries` work entries hold every live token of any step of T tokens over S
    slots: random ragged steps, and the steps that need the most entries (every live
    sequence's length one past a multiple of the block), where the bound is reached."""
    rng = np.random.default_rng()
    b = tokens_per_block
    for trial in range(20):
        S, T = int(rng.integers(1, 12)), int(rng.integers(1, 80))
        worst = trial % 2 == 0
        if worst:  # min(S, T) sequences of 1 + a multiple of b tokens, T of them in all
            live = min(S, T)
            blocks = (T - live) // b
            T = live + blocks * b
            q = 1 + b * rng.multinomial(blocks, np.ones(live) / live)
        else:
            live = int(rng.integers(1, min(S, T) + 1))
            q = rng.multinomial(T, np.ones(live) / live)  # some sequences get no token
        cu = np.zeros(S + 1, np.int32)
        cu[1:live + 1] = np.cumsum(q)
        cu[live + 1:] = cu[live]
        kv = np.zeros(S, np.int32)
        kv[:live] = q + rng.integers(0, 50, live)
        md = AttentionMetadata(jnp.asarray(cu), jnp.asarray(kv), jnp.zeros((S, 8), jnp.int32),
                               jnp.asarray([live], jnp.int32))
        n = mosaic._max_entries(T, S, b)
        work = np.asarray(mosaic._work_list(md, n, b))
        assert work[:, 2].sum() == q.sum(), (S, T, q.tolist(), b, n)
        need = int(np.sum(-(-q // b)))
        assert need <= n
        if worst:
            assert need == n, (S, T, q.tolist(), b)  # reached: no smaller bound holds


def describe(num_tokens: int, dtype=jnp.bfloat16, kv_dtype=None, hq=8, hkv=2, d=64,
             page_size=16, fused=False) -> AttentionCall:
    """The AttentionCall of a step of num_tokens tokens over 4 sequence slots (from shape
    structs, as the entry point describes its arguments)."""
    S = jax.ShapeDtypeStruct
    md = AttentionMetadata(cu_q_lens=S((5,), jnp.int32), kv_lens=S((4,), jnp.int32),
                           page_indices=S((4, 8), jnp.int32), num_seqs=S((1,), jnp.int32))
    pages = S((40, page_size, hkv, d), kv_dtype or dtype)
    if fused:
        q, k = S((num_tokens, (hq + 2 * hkv) * d), dtype), None
    else:
        q, k = S((num_tokens, hq, d), dtype), S((num_tokens, hkv, d), dtype)
    return AttentionCall.describe(q, k, pages, md)


def test_pallas_gpu_fuses_only_where_its_kernel_can():
    """The registry, not the kernel, decides where the one-token kernel reads the fused
    projection and applies the prologue: one token with pages in q's dtype; the kernel
    refuses to be handed them elsewhere."""
    entry = REGISTRY["pallas_gpu"]
    assert set(entry.fused(describe(1, fused=True))) == {"split_qkv", "qk_norm", "rope"}
    assert entry.fused(describe(1, kv_dtype=FP8_KV_DTYPE, fused=True)) == ()
    assert entry.fused(describe(2, fused=True)) == ()
    q = jnp.ones((2, (8 + 4) * 64), jnp.bfloat16)
    pages = jnp.ones((40, 16, 2, 64), jnp.bfloat16)
    md = AttentionMetadata(*(jnp.zeros(n, jnp.int32) for n in (5, 4, (4, 8), 1)))
    with pytest.raises(ValueError, match="fuses_prologue"):
        pallas_gpu_kernel.ragged_paged_attention_gpu(q, None, None, pages, pages, md,
                                                     sm_scale=0.125)


def test_mosaic_fuses_the_write_only_where_its_kernel_can():
    """The Mosaic entry takes the fused projection and the whole prologue (its k / v write
    kernel applies them) where the pages are in q's dtype or fp8; with q, k, v given
    apart, or in batch-invariant mode, XLA splits, scales, rotates and quantizes; the
    write kernel refuses other pages itself."""
    entry = REGISTRY["mosaic_gpu"]
    want = {"split_qkv", "row_scale", "qk_norm", "rope"}
    assert set(entry.fused(describe(256, fused=True))) == want
    assert set(entry.fused(describe(1, fused=True))) == want
    assert set(entry.fused(describe(256, kv_dtype=FP8_KV_DTYPE, fused=True))) == want
    assert entry.fused(describe(256)) == ()
    assert REGISTRY["mosaic_gpu_fixed"].fused(describe(256, fused=True)) == ()
    qkv = jnp.ones((2, (8 + 4) * 64), jnp.bfloat16)
    pages = jnp.ones((40, 16, 2, 64), jnp.float16)
    md = AttentionMetadata(*(jnp.zeros(n, jnp.int32) for n in (5, 4, (4, 8), 1)))
    with pytest.raises(ValueError, match="kv write kernel: .*pages in q's dtype or e4m3"):
        kv_write_gpu.write_kv_and_queries_gpu(qkv, pages, pages, md)


@pytest.mark.parametrize("name", ["decode", "mixed", "gqa3_d64", "page_size_8",
                                  "mqa_d128_sinks", "poison_nan", "fp8_kv"])
def test_kv_write_kernel_matches_oracle(name):
    """The k / v write kernel alone (interpreted): from the fused projection, q and k
    scaled, normed and rotated as the float64 oracle does to within rounding, q in token
    order, v the scaled rows exactly (on fp8 pages divided by its scale and rounded to
    e4m3 as `quantize_kv` does), written at each live token's (page, slot), padding tokens
    writing nothing and every other row of the pages (NaN in the poison case) as it was."""
    case = dataclasses.replace(CASES[name], dtype="bfloat16")
    b = build(case)
    rng = np.random.default_rng()
    prologue, seen = _prologue_oracle(case, b, True, rng, row_norm=True)
    T = b["q"].shape[0]
    qkv = jnp.concatenate([jnp.asarray(b[n], jnp.bfloat16).reshape(T, -1)
                           for n in ("q", "k", "v")], 1)
    md = AttentionMetadata(**{n: jnp.asarray(x) for n, x in b["md"].items()},
                           zero_tails=False)
    page_dtype = jnp.dtype(case.kv_dtype or "bfloat16")
    q, kp, vp = kv_write_gpu.write_kv_and_queries_gpu(
        qkv, jnp.asarray(b["k_pages"], page_dtype), jnp.asarray(b["v_pages"], page_dtype),
        md, prologue=prologue, k_scale=case.k_scale, v_scale=case.v_scale)
    assert kp.dtype == vp.dtype == page_dtype
    q, kp, vp = (np.asarray(x.astype(jnp.float32)) for x in (q, kp, vp))
    live = b["live_tokens"]
    tol = 2.0 ** -8 * 4
    np.testing.assert_allclose(q[:live], seen["q"][:live], rtol=tol,
                               atol=tol * np.abs(seen["q"]).max())
    k_exp, v_exp, written = expected_pages(case, seen, zero_tails=False)
    np.testing.assert_array_equal(kp[~written], k_exp[~written].astype(np.float32))
    np.testing.assert_array_equal(vp, v_exp.astype(np.float32))
    # k: the prologue's rounding, then (fp8) two e4m3 steps of it, in the pages' units
    page_tol = 2 * 2.0 ** -3 if case.kv_dtype else tol
    k_want = k_exp[written].astype(np.float32)
    np.testing.assert_allclose(kp[written], k_want, rtol=page_tol,
                               atol=tol * np.abs(k_want).max())


def test_call_description():
    """A fused projection is described by its query heads; the options by their presence."""
    call = describe(3, hq=6, hkv=2, d=128, fused=True)
    assert (call.num_tokens, call.num_q_heads, call.num_kv_heads, call.head_dim) == (3, 6, 2, 128)
    assert call.fused_qkv and call.query.shape == (3, 6, 128) and call.num_seqs == 4
    assert call == dataclasses.replace(describe(3, hq=6, hkv=2, d=128), fused_qkv=True)
    pages = jax.ShapeDtypeStruct((40, 16, 2, 64), FP8_KV_DTYPE)
    md = AttentionMetadata(*(jnp.zeros(n, jnp.int32) for n in (3, 2, (2, 4), 1)))
    call = AttentionCall.describe(jnp.zeros((1, 4, 64), jnp.bfloat16),
                                  jnp.zeros((1, 2, 64), jnp.bfloat16), pages, md,
                                  sliding_window=7, sinks=jnp.zeros(4),
                                  prologue=QKPrologue(jnp.zeros((1, 64)), jnp.zeros((1, 64))))
    assert (call.sliding_window, call.soft_cap, call.sinks, call.prologue) == (7, None, True, True)
    assert call.kv_dtype == FP8_KV_DTYPE and call.pages == pages


# What REGISTRY.pick chooses per platform for: a one-token bf16 step (batch-1 decode), a
# 4-token bf16 step, a one-token float32 step, a one-token step on fp8 pages, and a
# one-token step with head_dim 192 (not a power of two: the Pallas GPU kernel refuses it,
# the Mosaic kernel takes it).
PICKS = {
    "cpu": ("by_sequence",) * 5,
    "gpu": ("by_sequence",) * 5,
    "tpu": ("pallas_tpu",) * 5,
    "hopper": ("pallas_gpu", "mosaic_gpu", "by_sequence", "pallas_gpu", "mosaic_gpu"),
}


@pytest.mark.parametrize("platform", list(PICKS), ids=lambda p: f"on_{p}")  # not "gpu": a mark
def test_pick_by_platform_and_call(platform, monkeypatch):
    monkeypatch.setattr(platform_module, "platform", lambda: platform)
    calls = (describe(1), describe(4), describe(1, jnp.float32),
             describe(1, kv_dtype=FP8_KV_DTYPE), describe(1, d=192))
    assert tuple(REGISTRY.pick(call).name for call in calls) == PICKS[platform]
    reasons = REGISTRY.reasons(calls[1])
    assert reasons["reference"] is None
    if platform != "hopper":
        assert reasons["pallas_gpu"] == reasons["mosaic_gpu"] == f"needs hopper, this is {platform}"
    else:
        assert "PALLAS_GPU_MAX_TOKENS" in reasons["pallas_gpu"]
        assert reasons["pallas_tpu"] == "needs tpu, this is hopper"
        assert "q dtype float32" in REGISTRY.reasons(calls[2])["mosaic_gpu"]
        assert "head_dim 192" in REGISTRY.reasons(calls[4])["pallas_gpu"]
        assert describe(4).num_tokens > attention_registry.PALLAS_GPU_MAX_TOKENS
    # Forced: whatever the call.
    assert REGISTRY.pick(calls[2], "mosaic_gpu").name == "mosaic_gpu"


def test_pick_without_the_triton_lowering(monkeypatch):
    """A jax without the Pallas Triton lowering: one-token steps on Hopper take the Mosaic
    kernel, and forcing the Pallas GPU kernel fails with a one-line reason."""
    monkeypatch.setattr(platform_module, "platform", lambda: "hopper")
    monkeypatch.setitem(sys.modules, "jax.experimental.pallas.triton", None)  # import fails
    monkeypatch.delattr(pl, "triton", raising=False)
    monkeypatch.delitem(sys.modules, pallas_gpu_kernel.__name__)  # imported again
    assert REGISTRY.pick(describe(1)).name == "mosaic_gpu"
    assert "Triton" in REGISTRY.reasons(describe(1))["pallas_gpu"]
    b = build(CASES["single_token"])
    md = AttentionMetadata(**{n: jnp.asarray(x) for n, x in b["md"].items()})
    with pytest.raises(ValueError, match="no Pallas Triton lowering"):
        ragged_paged_attention(*(jnp.asarray(b[n], jnp.bfloat16) for n in
                                 ("q", "k", "v", "k_pages", "v_pages")), md, sm_scale=0.125,
                               implementation="pallas_gpu")


def test_kernel_limits():
    """A kernel's own `unsupported_reason` (what inputs it takes); an explicit Mosaic call with
    inputs it does not take fails with a one-line reason."""
    q = jnp.zeros((4, 8, 64), jnp.float32)
    pages = jnp.zeros((3, 16, 2, 64), jnp.float32)
    assert "float32" in mosaic.unsupported_reason(q, pages)
    assert mosaic.unsupported_reason(q.astype(jnp.bfloat16), pages.astype(jnp.bfloat16)) is None
    assert "page_size" in mosaic.unsupported_reason(q.astype(jnp.bfloat16),
                                                    jnp.zeros((3, 4, 2, 64), jnp.bfloat16))
    assert "head_dim 48" in pallas_gpu_kernel.unsupported_reason(
        jnp.zeros((1, 8, 48), jnp.bfloat16), jnp.zeros((3, 16, 2, 48), jnp.bfloat16))
    b = build(CASES["decode"])
    md = AttentionMetadata(**{n: jnp.asarray(x) for n, x in b["md"].items()})
    with pytest.raises(ValueError, match="mosaic attention: q dtype float32"):
        ragged_paged_attention(*(jnp.asarray(b[n]) for n in ("q", "k", "v", "k_pages",
                                                             "v_pages")), md,
                               sm_scale=0.125, implementation="mosaic_gpu")
    with pytest.raises(ValueError, match="attention implementation 'triton'"):
        ragged_paged_attention(*(jnp.asarray(b[n]) for n in ("q", "k", "v", "k_pages",
                                                             "v_pages")), md,
                               sm_scale=0.125, implementation="triton")


@pytest.mark.parametrize("platform,name,dtype,want", [
    ("hopper", "single_token", jnp.bfloat16, "pallas_gpu"),
    ("hopper", "decode", jnp.bfloat16, "mosaic_gpu"),
    ("hopper", "single_token", jnp.float32, "by_sequence"),
    ("tpu", "decode", jnp.float32, "pallas_tpu"),
])
def test_entry_point_runs_the_pick_and_the_work_it_does_not_fuse(platform, name, dtype, want,
                                                                 monkeypatch):
    """`ragged_paged_attention` runs the implementation REGISTRY.pick chooses (every entry
    patched to record its arguments), given a fused projection and a prologue: an entry
    whose `fuses` holds split_qkv, qk_norm and rope gets them as they are; any other gets
    q, k, v split and the prologue applied. The entry's `fuses` decides, not its name (the
    XLA entry, made to fuse them, gets them as they are too)."""
    got = {}

    def recorder(impl):
        def fn(q, k, v, k_pages, v_pages, md, **options):
            got.update(name=impl.name, q=q, k=k, v=v, options=options)
            return jnp.zeros(()), k_pages, v_pages
        return dataclasses.replace(impl, fn=fn)

    monkeypatch.setattr(platform_module, "platform", lambda: platform)
    patched = [recorder(impl) for impl in REGISTRY.implementations]
    monkeypatch.setattr(REGISTRY, "implementations", tuple(patched))
    monkeypatch.setattr(REGISTRY, "by_name", {impl.name: impl for impl in patched})
    case = CASES[name]
    b = build(case)
    md = AttentionMetadata(**{n: jnp.asarray(x) for n, x in b["md"].items()})
    q, k, v, kp, vp = (jnp.asarray(b[n], dtype) for n in ("q", "k", "v", "k_pages", "v_pages"))
    T = q.shape[0]
    qkv = jnp.concatenate([x.reshape(T, -1) for x in (q, k, v)], 1)
    rng = np.random.default_rng(0)
    cos, sin = (jnp.asarray(rng.standard_normal((T, case.d)), dtype) for _ in range(2))
    prologue = QKPrologue(cos, sin, jnp.full((case.d,), 1.5, dtype),
                          jnp.full((case.d,), 0.5, dtype))
    ragged_paged_attention(qkv, None, None, kp, vp, md, sm_scale=0.125, prologue=prologue)
    assert got["name"] == want
    fuses = REGISTRY[want].fused(AttentionCall.describe(qkv, None, kp, md, prologue=prologue))
    if {"split_qkv", "qk_norm", "rope"} <= set(fuses):
        assert got["q"] is qkv and got["k"] is None and got["options"]["prologue"] is prologue
    else:
        assert not fuses and "prologue" not in got["options"]
        want_q, want_k = prologue.apply(q, k)
        for x, y in ((got["q"], want_q), (got["k"], want_k), (got["v"], v)):
            np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    if want == "by_sequence":  # the same call, the XLA entry made to fuse the three
        i = [impl.name for impl in patched].index(want)
        fusing = dataclasses.replace(patched[i], fuses=("split_qkv", "qk_norm", "rope"))
        monkeypatch.setattr(REGISTRY, "implementations", (*patched[:i], fusing, *patched[i + 1:]))
        ragged_paged_attention(qkv, None, None, kp, vp, md, sm_scale=0.125, prologue=prologue)
        assert got["q"] is qkv and got["options"]["prologue"] is prologue


@pytest.mark.parametrize("live", [True, False])
@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.float8_e4m3fn])
def test_one_token_write_into_pages_with_a_scratch_page(live, kv_dtype):
    """A one-token step whose pages end with a scratch page (md.scratch_page, the runner's)
    writes with a dynamic_update_slice: a live token's k/v land in its slot (quantised as
    the scatter path does), a padding token's in the scratch page; no other row changes."""
    rng = np.random.default_rng()
    num_pages, ps, hkv, d = 9, 8, 2, 16
    scale = 0.5 if kv_dtype == FP8_KV_DTYPE else None
    pages = np.array([[6, 2, 4], [1, 3, 5]], np.int32)
    kv_len = int(rng.integers(1, 3 * ps + 1))  # after this token
    md = AttentionMetadata(cu_q_lens=jnp.array([0, 1, 1]), kv_lens=jnp.array([kv_len, 0]),
                           page_indices=jnp.asarray(pages),
                           num_seqs=jnp.array([1 if live else 0]), zero_tails=False,
                           scratch_page=True)
    k_pages, v_pages = (jnp.asarray(rng.standard_normal((num_pages, ps, hkv, d)),
                                    jnp.float32).astype(kv_dtype) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((1, hkv, d)) * 3, jnp.float32) for _ in range(2))
    got_k, got_v = jax.jit(functools.partial(write_kv_pages, k_scale=scale, v_scale=scale))(
        k, v, k_pages, v_pages, md)
    pos = kv_len - 1
    page, slot = (pages[0, pos // ps], pos % ps) if live else (num_pages - 1, None)
    for got, new, old in ((got_k, k, k_pages), (got_v, v, v_pages)):
        got, old = np.array(got.astype(jnp.float32)), np.asarray(old.astype(jnp.float32))
        want = old.copy()
        if live:
            want[page, slot] = np.asarray(quantize_kv(new[0], kv_dtype, scale)
                                          .astype(jnp.float32))
        else:  # only the scratch page may change
            want[page], got[page] = 0, 0
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("path,kv_dtype", [
    ("scatter", jnp.bfloat16), ("scatter", jnp.float8_e4m3fn), ("one_token", jnp.bfloat16),
    ("one_token", jnp.float8_e4m3fn), ("pallas_gpu_fused", jnp.bfloat16),
    ("kv_write_kernel", jnp.bfloat16), ("kv_write_kernel", jnp.float8_e4m3fn)])
def test_pages_store_finite_values_only(path, kv_dtype):
    """Every write path stores a non-finite k/v element (NaN, +-inf) as 0 and the rest as
    the page dtype holds them: XLA's scatter, its one-token update, the Pallas GPU
    kernel's own store of a fused projection and the Mosaic path's k / v write kernel
    (both interpreted here). So the runner's pages, zero at allocation, hold finite values
    only and its steps skip the tail zeroing (md.zero_tails False). No other slot
    changes."""
    rng = np.random.default_rng()
    num_pages, ps, hq, hkv, d = 9, 8, 4, 2, 64
    T = 3 if path in ("scatter", "kv_write_kernel") else 1
    fp8 = kv_dtype == FP8_KV_DTYPE
    scale = 0.5 if fp8 else None
    pages = np.array([[6, 2, 4], [1, 3, 5]], np.int32)
    kv_len = int(rng.integers(T, 3 * ps + 1))  # after this step
    md = AttentionMetadata(cu_q_lens=jnp.array([0, T, T]), kv_lens=jnp.array([kv_len, 0]),
                           page_indices=jnp.asarray(pages), num_seqs=jnp.array([1]),
                           zero_tails=False, scratch_page=T == 1)
    k_pages, v_pages = (jnp.asarray(rng.standard_normal((num_pages, ps, hkv, d)),
                                    jnp.float32).astype(kv_dtype) for _ in range(2))
    new = []
    for _ in range(2):  # k, v: a NaN, +inf and -inf each, at random elements
        x = rng.standard_normal((T, hkv, d)) * 3
        flat = x.reshape(-1)
        flat[rng.choice(flat.size, 3, replace=False)] = [np.nan, np.inf, -np.inf]
        new.append(np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)))
    k, v = (jnp.asarray(x, jnp.bfloat16) for x in new)
    if path in ("pallas_gpu_fused", "kv_write_kernel"):
        q = jnp.asarray(rng.standard_normal((T, hq, d)), jnp.bfloat16)
        qkv = jnp.concatenate([x.reshape(T, -1) for x in (q, k, v)], axis=1)
        if path == "kv_write_kernel":
            _, got_k, got_v = kv_write_gpu.write_kv_and_queries_gpu(
                qkv, k_pages, v_pages, md, k_scale=scale, v_scale=scale)
        else:
            _, got_k, got_v = jax.jit(functools.partial(
                pallas_gpu_kernel.ragged_paged_attention_gpu, sm_scale=d ** -0.5))(
                qkv, None, None, k_pages, v_pages, md)
    else:
        got_k, got_v = jax.jit(functools.partial(write_kv_pages, k_scale=scale,
                                                 v_scale=scale))(k, v, k_pages, v_pages, md)
    limit = float(jnp.finfo(FP8_KV_DTYPE).max)
    for got, x, old in ((got_k, new[0], k_pages), (got_v, new[1], v_pages)):
        stored = np.where(np.isfinite(x), x, 0.0)
        if fp8:
            stored = np.clip(stored / scale, -limit, limit).astype(FP8_KV_DTYPE)
        want = np.array(old.astype(jnp.float32))
        for t in range(T):
            pos = kv_len - T + t
            want[pages[0, pos // ps], pos % ps] = np.asarray(stored[t], np.float32)
        got = np.asarray(got.astype(jnp.float32))
        assert np.isfinite(got).all()
        np.testing.assert_array_equal(got, want)


# The q/k prologue (`QKPrologue`: per-head RMSNorm, then RoPE). The Pallas GPU kernel applies
# it itself at one token (T = 1) on pages in q's dtype; XLA applies it everywhere else.
PROLOGUE_CASES = {
    "single_token": CASES["single_token"],
    "one_token_gqa8_d128": Case(seqs=((1, 45),), hq=8, hkv=1, d=128, pad_seqs=0,
                                pad_tokens=0),
    "one_token_window_sinks": Case(seqs=((1, 29),), sliding_window=9, sinks=True, pad_seqs=0,
                                   pad_tokens=0, poison=float("nan")),
    "one_token_fp8": Case(seqs=((1, 20),), dtype="bfloat16", kv_dtype="float8_e4m3fn",
                          k_scale=2.0**-6, v_scale=2.0**-5, pad_seqs=0, pad_tokens=0),
    "mixed": CASES["mixed"],
}


def _prologue_oracle(case: Case, b, norm: bool, rng, row_norm: bool = False):
    """A random prologue for the case's tokens, and b with q / k replaced by the float64
    result (rounded to the case's dtype): what attention then sees. row_norm: the
    prologue scales each token's q, k and v by the 1 / rms of a random `RowNorm` first
    (v: in float32, rounded once, as `linear` does)."""
    T, d = b["q"].shape[0], case.d
    pos = np.zeros(T, np.int32)
    t0 = 0
    for q_len, kv_len in zip(b["q_lens"], b["kv_lens"], strict=True):
        pos[t0:t0 + q_len] = kv_len - q_len + np.arange(q_len)
        t0 += q_len
    inv_freq = 1.0 / 500.0 ** (np.arange(0, d, 2) / d)
    factor, eps = 1.25, 0.5  # (an eps that shows: rms(x) ~ 1)
    dt = jnp.dtype(case.dtype)
    scales = [np.asarray(jnp.asarray(rng.uniform(0.5, 1.5, d), dt).astype(jnp.float32))
              for _ in range(2)] if norm else [None, None]

    # 1 / rms near 1 (larger q and k sharpen the softmax past the bf16 tolerances below)
    stat = rows = None
    if row_norm:
        dim, row_eps = 4096, 1e-5
        target = rng.uniform(0.8, 1.25, (T, 1))
        stat = RowNorm(jnp.asarray(dim * (1 / target ** 2 - row_eps), jnp.float32), dim,
                       row_eps)
        # The scale in float32 as `RowNorm.inverse` rounds it (a kernel computing it so
        # gives v to the bit; `test_row_norm_matches_float64` checks that value itself).
        rows = np.asarray(stat.inverse())

    def scaled(x):  # [T, H, D] times the row scale, in float32 rounded to the dtype
        if rows is None:
            return x
        return np.array(jnp.asarray(x.astype(np.float32) * rows[:, :, None])
                        .astype(case.dtype).astype(jnp.float32))

    def want(x, scale):
        x = scaled(x).astype(np.float64)
        if scale is not None:
            x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale
        angle = pos[:, None, None] * np.concatenate([inv_freq, inv_freq])
        rotated = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
        out = (x * np.cos(angle) + rotated * np.sin(angle)) * factor
        return np.array(jnp.asarray(out, jnp.float32).astype(dt).astype(jnp.float32))

    cos, sin = rope_tables(jnp.asarray(pos), jnp.asarray(inv_freq, jnp.float32), factor, dt)
    prologue = QKPrologue(cos, sin, *(None if s is None else jnp.asarray(s, dt) for s in scales),
                          eps=eps, row_norm=stat)
    return prologue, dict(b, q=want(b["q"], scales[0]), k=want(b["k"], scales[1]),
                          v=scaled(b["v"]))


def test_row_norm_matches_float64():
    """`RowNorm` (and `inverse_rms`, which uses it): 1 / sqrt(mean(x^2) + eps) of each row,
    against float64, on rows of several magnitudes."""
    rng = np.random.default_rng()
    x = (rng.standard_normal((37, 576)) * rng.uniform(0.01, 100, (37, 1))).astype(np.float32)
    eps = 1e-5
    want = 1 / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + eps)
    stat = RowNorm.of(jnp.asarray(x), eps)
    assert stat.sum_sq.shape == (37, 1) and stat.dim == 576
    np.testing.assert_allclose(np.asarray(stat.inverse()), want, rtol=2e-6)
    np.testing.assert_array_equal(np.asarray(inverse_rms(jnp.asarray(x), eps)),
                                  np.asarray(stat.inverse()))


PROLOGUE_BACKENDS = [("reference", "cpu"), ("pallas_gpu", "cpu"),
                     pytest.param("pallas_gpu", "gpu", marks=gpu),
                     pytest.param("mosaic_gpu", "gpu", marks=gpu)]


@pytest.mark.parametrize("implementation,platform", PROLOGUE_BACKENDS)
@pytest.mark.parametrize("fused", [False, True], ids=["qkv", "fused_qkv"])
@pytest.mark.parametrize("norm", [True, False], ids=["norm_rope", "rope"])
@pytest.mark.parametrize("name", list(PROLOGUE_CASES))
def test_qk_prologue_matches_oracle(name, norm, fused, implementation, platform,
                                    monkeypatch):
    """Attention on raw q / k with a prologue (and q, k, v separate, or as one fused
    projection, with a row scale as the model gives it) against the float64 oracle on q /
    k scaled, normed and rotated in float64; the pages hold the normed, rotated k (to within
    rounding: the kernels and XLA round their steps to the dtype where the oracle rounds
    once). On pages in q's dtype the Pallas GPU kernel at one token, and the Mosaic
    kernel's k / v write kernel given the fused projection, must apply the prologue
    themselves (XLA's `apply` is not called) and read the fused projection whole
    (`split_qkv` is not called)."""
    check_prologue(PROLOGUE_CASES[name], norm, fused, implementation, platform, monkeypatch)


@pytest.mark.parametrize("name,norm", [("mixed", True), ("mixed", False),
                                       ("one_token_fp8", True)])
def test_mosaic_write_kernel_prologue_matches_oracle(name, norm, monkeypatch):
    """The Mosaic entry on the fused projection, interpreted: the k / v write kernel (its
    prologue, q in token order for the attention kernel, the pages in q's dtype or fp8
    with scales) and the attention kernel after it, against the float64 oracle, as
    `test_qk_prologue_matches_oracle`."""
    check_prologue(PROLOGUE_CASES[name], norm, True, "mosaic_gpu", "cpu", monkeypatch)


def check_prologue(case: Case, norm: bool, fused: bool, implementation: str, platform: str,
                   monkeypatch):
    """`test_qk_prologue_matches_oracle`'s check: fused inputs carry a row scale."""
    if implementation != "reference":
        case = dataclasses.replace(case, dtype="bfloat16")
    b = build(case)
    prologue, seen = _prologue_oracle(case, b, norm, np.random.default_rng(case.seed),
                                      row_norm=fused)
    applied, real_apply = [], QKPrologue.apply
    monkeypatch.setattr(QKPrologue, "apply",
                        lambda self, q, k: applied.append(1) or real_apply(self, q, k))
    splits, real_split = [], attention_registry.split_qkv
    monkeypatch.setattr(attention_registry, "split_qkv",
                        lambda *a: splits.append(1) or real_split(*a))
    with jax.default_device(jax.devices(platform)[0]), jax.default_matmul_precision("highest"):
        out, kp, vp = run(case, b, implementation, prologue, fused)
    in_kernel = ((implementation == "pallas_gpu" and b["q"].shape[0] == 1
                  and case.kv_dtype is None) or (implementation == "mosaic_gpu" and fused))
    assert bool(applied) != in_kernel
    assert bool(splits) == (fused and not in_kernel)
    tol = 1e-5 if case.dtype == "float32" else 2e-2
    live = out[:b["live_tokens"]]
    assert np.isfinite(live).all()
    np.testing.assert_allclose(live, oracle(case, seen), rtol=tol, atol=tol)
    k_exp, v_exp, written = expected_pages(case, seen)
    np.testing.assert_array_equal(kp[~written], k_exp[~written].astype(np.float32))
    np.testing.assert_array_equal(vp, v_exp.astype(np.float32))  # v: the row scale only
    # Written k rows to within rounding: the prologue's own steps (bf16: a few steps of the
    # largest term; float32: RoPE's angles pos * inv_freq, ~1e-6 at 40 radians), then the
    # pages' dtype (e4m3: two steps of 4 bits of mantissa). In k's units.
    ks = (case.k_scale or 1.0) if case.kv_dtype else 1.0
    got_k, want_k = kp[written] * ks, k_exp[written].astype(np.float32) * ks
    compute = 2.0 ** -8 if case.dtype == "bfloat16" else 5e-6
    page = 2.0 ** -3 if case.kv_dtype else compute
    np.testing.assert_allclose(got_k, want_k, rtol=2 * page,
                               atol=4 * compute * np.abs(want_k).max())


def test_a_runner_imports_its_platforms_kernels_before_loading_programs():
    """Programs loaded from disk call into the kernels' runtimes, which their modules load
    on import (Mosaic GPU's host symbols): on Hopper the runner imports them; on the CPU
    none (they are imported on first use)."""
    code = textwrap.dedent("""
        import sys
        import jaxinfer.ops.platform as platform
        from jaxinfer.ops.kernels import import_platform_kernels
        assert import_platform_kernels() == []
        assert not any(m.startswith("jaxinfer.mosaic.") for m in sys.modules)
        platform.platform = lambda: "hopper"
        names = import_platform_kernels()
        assert set(names) == {"jaxinfer.mosaic.ragged_paged_attention",
                              "jaxinfer.mosaic.quantized_matmul",
                              "jaxinfer.mosaic.grouped_matmul",
                              "jaxinfer.pallas_kernels.ragged_paged_attention_gpu",
                              "jaxinfer.pallas_kernels.kv_write_gpu",
                              "jaxinfer.pallas_kernels.fp8_rows_gpu",
                              "jaxinfer.mosaic.fp8_blocks_matmul"}, names
        assert all(n in sys.modules for n in names)
        assert "jax.experimental.mosaic.gpu" in sys.modules
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_mosaic_fp8_prefill_config_fits_shared_memory():
    """fp8 pages with two consumer warpgroups (a prefill-heavy step) at head_dim 128: 128-token
    KV blocks need 260 KB of shared memory even at 2 stages; the fit halves the block."""
    cfg = mosaic.choose_config(2048, 8, 8, 8192, 128, 4)
    assert cfg.compute_wgs == 2 and cfg.block_kv == 128
    bf16 = mosaic._fit_stages(cfg, 128, jnp.bfloat16, jnp.bfloat16)
    fp8 = mosaic._fit_stages(cfg, 128, jnp.bfloat16, jnp.float8_e4m3fn)
    assert bf16.block_kv == 128  # fits as it is
    assert (fp8.block_kv, fp8.num_stages) == (64, 2)
    # The kernel runs what the fit gives, not the block it was asked for (interpret mode
    # here, the GPU with -m gpu): fp8 pages, a prefill-heavy step, asked for 128.
    orig = mosaic.choose_config
    mosaic.choose_config = lambda *a, **k: mosaic.Config(128, 2, 2, 1)
    try:
        check_against_oracle(dataclasses.replace(CASES["fp8_kv"], d=128), "mosaic_gpu",
                             "gpu" if jax.default_backend() == "gpu" else "cpu")
    finally:
        mosaic.choose_config = orig


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_mosaic_batch_invariant_config_is_one_for_every_step(kv_dtype):
    """Batch-invariant mode: decode-like (split-KV) and prefill-heavy steps get the same KV
    block, no splits and every block masked, a block that fits shared memory in both;
    without the mode they differ (else the check could not fail)."""
    steps = [(8, 256, 8192), (256, 256, 8192), (2048, 256, 8192), (1, 1, 65536)]
    chosen = [mosaic.choose_config(t, s, 8, ctx, 128, 4) for t, s, ctx in steps]
    fitted = [mosaic._fit_stages(c, 128, jnp.bfloat16, kv_dtype) for c in chosen]
    assert len({(c.block_kv, c.num_splits) for c in fitted}) > 1
    assert not any(c.mask_every_block for c in fitted)
    fixed = [mosaic._fit_stages(mosaic.batch_invariant_config(c, 128, jnp.bfloat16, kv_dtype),
                                128, jnp.bfloat16, kv_dtype) for c in chosen]
    assert len({(c.block_kv, c.num_splits, c.mask_every_block) for c in fixed}) == 1
    assert fixed[0].num_splits == 1 and fixed[0].mask_every_block


def _rows_of_one_prompt(start: int, beside: bool, slots: int, data):
    """The Mosaic kernel's batch-invariant output rows for tokens start.. of one sequence
    whose pages already hold all its k/v (a chunk of a prompt, or a decode when one token is
    left), alone in the step or behind another sequence's prefill, in a step of `slots`
    sequence slots (256: steps of up to 512 tokens take the decode configuration)."""
    q_full, q_other, k_pages, v_pages, page_size = data
    length, other = q_full.shape[0], q_other.shape[0]
    n = length - start
    pages = jnp.arange(length // page_size, dtype=jnp.int32)
    other_pages = length // page_size + jnp.arange(-(-other // page_size), dtype=jnp.int32)
    table = jnp.zeros((slots, pages.shape[0]), jnp.int32)
    lens = [other, n] if beside else [n]
    kv_lens = ([other, length] if beside else [length]) + [0] * (slots - len(lens))
    cu = np.concatenate([[0], np.cumsum(lens), np.full(slots - len(lens), sum(lens))])
    if beside:
        q = jnp.concatenate([q_other, q_full[start:]])
        table = table.at[0, :other_pages.shape[0]].set(other_pages).at[1].set(pages)
    else:
        q = q_full[start:]
        table = table.at[0].set(pages)
    md = AttentionMetadata(cu_q_lens=jnp.asarray(cu, jnp.int32),
                           kv_lens=jnp.array(kv_lens, jnp.int32), page_indices=table,
                           num_seqs=jnp.array([len(lens)], jnp.int32))
    out = mosaic.attend_pages_mgpu(q, k_pages, v_pages, md, sm_scale=q.shape[-1] ** -0.5,
                                   batch_invariant=True)
    return np.asarray(out[-n:].astype(jnp.float32))


@gpu
def test_mosaic_batch_invariant_rows_whatever_the_chunking():
    """Batch-invariant mode on Hopper: a query row gets the same bits whether its prompt
    arrives whole, in chunks that start anywhere (work entries that straddle KV blocks), or
    as a decode, alone or beside another prefill, in steps of the prefill or the decode
    configuration. The Llama-3-8B shape: 32 query heads over 8 KV heads, head_dim 128,
    contexts of 800."""
    rng = np.random.default_rng()
    length, other, page_size, hq, hkv, d = 800, 333, 16, 32, 8, 128
    num_pages = length // page_size + -(-other // page_size)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)

    data = (normal(length, hq, d), normal(other, hq, d), normal(num_pages, page_size, hkv, d),
            normal(num_pages, page_size, hkv, d), page_size)
    whole = _rows_of_one_prompt(0, False, 4, data)
    assert np.isfinite(whole).all()
    for start, beside, slots in [(0, True, 4), (137, False, 4), (630, True, 4), (700, False, 4),
                                 (777, True, 4), (799, False, 4), (799, True, 4),
                                 (0, False, 256), (630, True, 256), (777, False, 256),
                                 (799, True, 256)]:
        rows = _rows_of_one_prompt(start, beside, slots, data)
        differ = (rows != whole[start:]).any(axis=(1, 2))
        assert not differ.any(), (start, beside, slots, np.flatnonzero(differ)[:8] + start)
