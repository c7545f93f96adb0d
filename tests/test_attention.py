"""`ragged_paged_attention` (the dispatcher) against an independent float64 NumPy oracle.

Each case builds a ragged batch by hand: random page arrays, random (shuffled,
non-contiguous) page ids per sequence, cache history written into the right
(page, slot), padding sequences after `num_seqs` and padding tokens after
`cu_q_lens[num_seqs]`. The oracle attends densely over each sequence's full
K/V history (old cache + this step's k/v), so it never looks at the pages.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.attention import AttentionMetadata, ragged_paged_attention


@dataclasses.dataclass(frozen=True)
class Case:
    seqs: tuple[tuple[int, int], ...]  # live (q_len, kv_len) pairs
    page_size: int = 16
    hq: int = 4
    hkv: int = 2
    d: int = 64
    pad_seqs: int = 1  # padding sequences after num_seqs
    pad_tokens: int = 3  # padding tokens after cu_q_lens[num_seqs]
    pad_style: str = "zeros"  # "zeros" (like the runner) or "garbage" metadata for padding seqs
    extra_pages: int = 2  # pages per sequence beyond what kv_len needs
    sliding_window: int | None = None
    soft_cap: float | None = None
    sinks: bool = False
    q_scale: float = 1.0  # scales q (to make the soft cap bite)
    dtype: str = "float32"
    poison: float | None = None  # fill unowned / beyond-kv_len slots with +-poison
    seed: int = 0


CASES = {
    "decode": Case(seqs=((1, 5), (1, 9), (1, 3), (1, 12))),
    "prefill": Case(seqs=((7, 7), (16, 16), (20, 20))),
    "mixed": Case(seqs=((12, 30), (1, 9), (5, 5), (1, 16), (3, 40)), pad_seqs=2),
    "kv_len_1": Case(seqs=((1, 1),), pad_seqs=2),
    "kv_len_1_mixed": Case(seqs=((1, 1), (1, 2), (4, 4), (1, 1))),
    "page_boundary_decode": Case(seqs=((1, 16), (1, 17), (1, 32), (1, 33))),
    "page_boundary_prefill": Case(seqs=((16, 16), (17, 17), (32, 32), (33, 33))),
    "chunk_across_boundary": Case(seqs=((4, 18), (16, 32), (2, 17), (15, 33))),
    "chunked_prefill": Case(seqs=((8, 40), (16, 48), (5, 21)), pad_seqs=0),
    "no_padding": Case(seqs=((3, 10), (1, 20)), pad_seqs=0, pad_tokens=0),
    "garbage_padding_meta": Case(seqs=((6, 20), (1, 33), (9, 9)), pad_seqs=3, pad_tokens=6,
                                 pad_style="garbage"),
    "page_size_8": Case(seqs=((9, 24), (1, 8), (8, 8), (1, 9)), page_size=8),
    "sliding_window": Case(seqs=((12, 30), (1, 20), (20, 20), (5, 40)), sliding_window=8),
    "sliding_window_1": Case(seqs=((6, 10), (1, 5)), sliding_window=1),
    "sliding_window_wide": Case(seqs=((6, 10), (1, 5)), sliding_window=100),
    "soft_cap": Case(seqs=((12, 30), (1, 9), (7, 7)), soft_cap=2.0, q_scale=4.0),
    "sinks": Case(seqs=((12, 30), (1, 9), (7, 7), (1, 1)), sinks=True),
    "window_cap_sinks": Case(seqs=((12, 30), (1, 17), (9, 9)), sliding_window=6, soft_cap=3.0,
                             sinks=True, q_scale=3.0, pad_style="garbage"),
    "mha_d128": Case(seqs=((5, 21), (1, 16), (8, 8)), hq=4, hkv=4, d=128),
    "gqa_d128": Case(seqs=((5, 21), (1, 16), (8, 8)), hq=8, hkv=2, d=128),
    "mqa_d64": Case(seqs=((5, 21), (1, 16), (8, 8)), hq=4, hkv=1, d=64),
    "mqa_d128_sinks": Case(seqs=((5, 21), (1, 33)), hq=6, hkv=1, d=128, sinks=True),
    "gqa3_d64": Case(seqs=((5, 21), (1, 17), (8, 8)), hq=6, hkv=2, d=64, sliding_window=5),
    "poison": Case(seqs=((12, 30), (1, 9), (5, 5), (1, 16)), poison=1e30, pad_style="garbage"),
    "poison_nan": Case(seqs=((12, 30), (1, 9), (5, 5), (1, 16)), poison=float("nan"),
                       pad_style="garbage"),
    "poison_window_sinks": Case(seqs=((12, 30), (1, 20)), poison=1e30, sliding_window=4,
                                sinks=True),
    "bf16": Case(seqs=((12, 30), (1, 9), (5, 5), (1, 16)), dtype="bfloat16", hq=8, hkv=2),
    "bf16_cap_sinks": Case(seqs=((6, 20), (1, 33)), dtype="bfloat16", soft_cap=2.0, q_scale=4.0,
                           sinks=True, sliding_window=10),
}


def build(case: Case):
    """Random inputs + metadata + the per-sequence history the test wrote into the pages."""
    rng = np.random.default_rng(case.seed)
    ps, hq, hkv, d = case.page_size, case.hq, case.hkv, case.d
    n_live = len(case.seqs)
    S = n_live + case.pad_seqs
    q_lens = [q for q, _ in case.seqs]
    kv_lens = [kv for _, kv in case.seqs]
    assert all(1 <= q <= kv for q, kv in case.seqs)
    live_tokens = sum(q_lens)
    T = live_tokens + case.pad_tokens
    needed = [-(-kv // ps) for kv in kv_lens]
    P = max(needed) + case.extra_pages
    num_pages = sum(needed) + 5  # 5 pages owned by no sequence

    pool = rng.permutation(num_pages).astype(np.int32)
    page_indices = np.zeros((S, P), np.int32)
    owned = []
    start = 0
    for s in range(n_live):
        own = pool[start:start + needed[s]]
        start += needed[s]
        owned.append(own)
        page_indices[s, :needed[s]] = own
        # Entries past the pages a sequence needs are unused: point them anywhere
        # (including other sequences' pages), as the runner does with page 0.
        page_indices[s, needed[s]:] = rng.integers(0, num_pages, P - needed[s])
    unowned = pool[start:]
    assert len(unowned) == 5

    cu_q_lens = np.zeros(S + 1, np.int32)
    cu_q_lens[1:n_live + 1] = np.cumsum(q_lens)
    kv_arr = np.zeros(S, np.int32)
    kv_arr[:n_live] = kv_lens
    if case.pad_style == "zeros":
        cu_q_lens[n_live + 1:] = live_tokens
    else:  # garbage: padding sequences claim the padding tokens and live pages
        assert case.pad_style == "garbage"
        if case.pad_seqs:
            cuts = np.sort(rng.integers(live_tokens, T + 1, case.pad_seqs))
            cuts[-1] = T
            cu_q_lens[n_live + 1:] = cuts
            kv_arr[n_live:] = rng.integers(1, P * ps + 1, case.pad_seqs)
            page_indices[n_live:] = rng.integers(0, num_pages, (case.pad_seqs, P))
    num_seqs = np.array([n_live], np.int32)

    shape = (num_pages, ps, hkv, d)
    k_pages = rng.standard_normal(shape)
    v_pages = rng.standard_normal(shape)
    if case.poison is not None:
        sign = rng.choice([-1.0, 1.0], size=(2,) + shape)
        k_pages = case.poison * sign[0]
        v_pages = case.poison * sign[1]

    # Old cache contents (positions [0, kv_len - q_len)), written where they belong.
    hist_k, hist_v = [], []
    for s in range(n_live):
        h = kv_lens[s] - q_lens[s]
        hk = rng.standard_normal((h, hkv, d))
        hv = rng.standard_normal((h, hkv, d))
        for p in range(h):
            k_pages[page_indices[s, p // ps], p % ps] = hk[p]
            v_pages[page_indices[s, p // ps], p % ps] = hv[p]
        hist_k.append(hk)
        hist_v.append(hv)

    q = rng.standard_normal((T, hq, d)) * case.q_scale
    k = rng.standard_normal((T, hkv, d))
    v = rng.standard_normal((T, hkv, d))
    sinks = rng.standard_normal(hq) * 2.0 if case.sinks else None

    # Round everything to the compute dtype once, so the oracle sees what jax sees.
    dt = jnp.dtype(case.dtype)

    def rnd(x):
        return np.array(jnp.asarray(x, jnp.float32).astype(dt))

    q, k, v, k_pages, v_pages = map(rnd, (q, k, v, k_pages, v_pages))
    hist_k = [rnd(x) for x in hist_k]
    hist_v = [rnd(x) for x in hist_v]
    if sinks is not None:
        sinks = np.asarray(sinks, np.float32)
    md = dict(cu_q_lens=cu_q_lens, kv_lens=kv_arr, page_indices=page_indices, num_seqs=num_seqs)
    return dict(q=q, k=k, v=v, k_pages=k_pages, v_pages=v_pages, sinks=sinks, md=md,
                hist_k=hist_k, hist_v=hist_v, q_lens=q_lens, kv_lens=kv_lens,
                live_tokens=live_tokens, owned=owned, unowned=unowned)


def oracle(case: Case, b):
    """Dense float64 attention per live sequence: [live_tokens, Hq, D]."""
    hq, hkv, d = case.hq, case.hkv, case.d
    group = hq // hkv
    scale = d ** -0.5
    out = np.zeros((b["live_tokens"], hq, d))
    t0 = 0
    for s, (q_len, kv_len) in enumerate(zip(b["q_lens"], b["kv_lens"], strict=True)):
        hist = kv_len - q_len
        kf = np.concatenate([b["hist_k"][s], b["k"][t0:t0 + q_len]]).astype(np.float64)
        vf = np.concatenate([b["hist_v"][s], b["v"][t0:t0 + q_len]]).astype(np.float64)
        assert kf.shape == (kv_len, hkv, d)
        for i in range(q_len):
            pos = hist + i
            qi = b["q"][t0 + i].astype(np.float64)
            js = np.arange(kv_len)
            allowed = js <= pos
            if case.sliding_window is not None:
                allowed &= pos - js < case.sliding_window
            for h in range(hq):
                kh = h // group
                sc = kf[:, kh] @ qi[h] * scale
                if case.soft_cap is not None:
                    sc = case.soft_cap * np.tanh(sc / case.soft_cap)
                sc = sc[allowed]
                m = sc.max()
                if b["sinks"] is not None:
                    m = max(m, float(b["sinks"][h]))
                e = np.exp(sc - m)
                denom = e.sum()
                if b["sinks"] is not None:
                    denom += np.exp(float(b["sinks"][h]) - m)
                out[t0 + i, h] = (e / denom) @ vf[allowed, kh]
        t0 += q_len
    return out


def expected_pages(case: Case, b):
    """The input pages with this step's live k/v written at (page, slot)."""
    k_exp, v_exp = b["k_pages"].copy(), b["v_pages"].copy()
    written = np.zeros(k_exp.shape[:2], bool)
    pi = b["md"]["page_indices"]
    t0 = 0
    for s, (q_len, kv_len) in enumerate(zip(b["q_lens"], b["kv_lens"], strict=True)):
        for i in range(q_len):
            pos = kv_len - q_len + i
            page, slot = pi[s, pos // case.page_size], pos % case.page_size
            assert page in b["owned"][s]
            assert not written[page, slot]
            written[page, slot] = True
            k_exp[page, slot] = b["k"][t0 + i]
            v_exp[page, slot] = b["v"][t0 + i]
        t0 += q_len
    return k_exp, v_exp, written


def run(case: Case, b):
    fn = jax.jit(functools.partial(
        ragged_paged_attention, sm_scale=case.d ** -0.5, sliding_window=case.sliding_window,
        soft_cap=case.soft_cap))
    md = AttentionMetadata(**{n: jnp.asarray(x) for n, x in b["md"].items()})
    dt = jnp.dtype(case.dtype)
    sinks = None if b["sinks"] is None else jnp.asarray(b["sinks"])
    out, kp, vp = fn(
        jnp.asarray(b["q"], dt), jnp.asarray(b["k"], dt), jnp.asarray(b["v"], dt),
        jnp.asarray(b["k_pages"], dt), jnp.asarray(b["v_pages"], dt), md, sinks=sinks)
    assert out.dtype == dt and kp.dtype == dt and vp.dtype == dt
    assert out.shape == b["q"].shape
    assert kp.shape == b["k_pages"].shape and vp.shape == b["v_pages"].shape
    return (np.asarray(out.astype(jnp.float32)), np.asarray(kp.astype(jnp.float32)),
            np.asarray(vp.astype(jnp.float32)))


PLATFORMS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_oracle(name, platform):
    case = CASES[name]
    b = build(case)
    # Full float32 matmuls on GPUs too (their default is TF32 for float32 dots).
    with jax.default_device(jax.devices(platform)[0]), jax.default_matmul_precision("highest"):
        out, kp, vp = run(case, b)
    live = out[:b["live_tokens"]]

    # (c) no NaN / inf in live outputs, whatever the pages held.
    bad = np.argwhere(~np.isfinite(live))[:5]
    assert np.isfinite(live).all(), f"non-finite live outputs at {bad}"

    # (a) live outputs match the float64 oracle.
    want = oracle(case, b)
    tol = 1e-5 if case.dtype == "float32" else 2e-2
    np.testing.assert_allclose(live, want, rtol=tol, atol=tol)

    # (b) new k/v at the right (page, slot); every other slot unchanged.
    k_exp, v_exp, written = expected_pages(case, b)
    assert written.sum() == b["live_tokens"]
    np.testing.assert_array_equal(kp, k_exp.astype(np.float32))
    np.testing.assert_array_equal(vp, v_exp.astype(np.float32))
    # And the write really changed the slots (k/v differ from the old page contents).
    assert not np.array_equal(kp[written], b["k_pages"][written])
    assert not np.array_equal(vp[written], b["v_pages"][written])


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
