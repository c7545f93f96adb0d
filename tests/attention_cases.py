"""Ragged paged attention cases and an independent float64 NumPy oracle.

Each case builds a ragged batch by hand: random page arrays, random (shuffled,
non-contiguous) page ids per sequence, cache history written into the right
(page, slot), padding sequences after `num_seqs` and padding tokens after
`cu_q_lens[num_seqs]`. The oracle attends densely over each sequence's full
K/V history (old cache + this step's k/v), so it never looks at the pages.
Shared by the tests of every implementation the attention registry lists.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np


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
    kv_dtype: str | None = None  # None: the pages hold `dtype`; "float8_e4m3fn": fp8 KV cache
    # Powers of two, so x / scale is exact and the test's rounding to e4m3 cannot differ
    # from jax's (XLA may divide by multiplying with the reciprocal).
    k_scale: float | None = None
    v_scale: float | None = None
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
    # A speculative-decoding verify step (each sequence's last token and its drafts: q_len > 1
    # at decode positions, one run across a page boundary), with no padding sequence or token.
    "verify_no_padding": Case(seqs=((4, 18), (4, 37), (3, 9)), pad_seqs=0, pad_tokens=0),
    # One decode token, unpadded: the runner's batch-1 decode step (T = S = 1).
    "single_token": Case(seqs=((1, 37),), pad_seqs=0, pad_tokens=0),
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
    "fp8_kv": Case(seqs=((12, 30), (1, 9), (5, 5), (1, 16)), dtype="bfloat16", hq=8, hkv=2,
                   kv_dtype="float8_e4m3fn", k_scale=2.0**-6, v_scale=2.0**-5),
    "fp8_kv_unscaled_poison": Case(seqs=((6, 20), (1, 33), (1, 1)), dtype="bfloat16",
                                   kv_dtype="float8_e4m3fn", poison=float("nan"),
                                   pad_style="garbage"),
}

FP8 = ml_dtypes.float8_e4m3fn


def kv_store(case: Case, x):
    """What a page holds for the float values x: x in `dtype`, or x / scale clipped to e4m3."""
    if case.kv_dtype is None:
        return np.array(jnp.asarray(x, jnp.float32).astype(case.dtype))
    assert case.kv_dtype == "float8_e4m3fn"
    limit = float(ml_dtypes.finfo(FP8).max)
    return np.clip(np.asarray(x, np.float32), -limit, limit).astype(FP8)


def kv_load(case: Case, stored, scale):
    """The value attention sees for a stored page entry (float64)."""
    out = np.asarray(stored).astype(np.float64)
    return out * scale if (case.kv_dtype and scale is not None) else out


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

    q, k, v = map(rnd, (q, k, v))
    ks = case.k_scale if case.k_scale is not None else 1.0
    vs = case.v_scale if case.v_scale is not None else 1.0
    if case.kv_dtype is not None:  # the pages store k / k_scale (history included)
        k_pages, v_pages = k_pages / ks, v_pages / vs
    k_pages, v_pages = kv_store(case, k_pages), kv_store(case, v_pages)
    # The history the oracle sees is what the pages hold, read back.
    hist_k = [np.asarray(kv_load(case, kv_store(case, x / ks if case.kv_dtype else x),
                                 case.k_scale), np.float32) for x in hist_k]
    hist_v = [np.asarray(kv_load(case, kv_store(case, x / vs if case.kv_dtype else x),
                                 case.v_scale), np.float32) for x in hist_v]
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
        new_k, new_v = b["k"][t0:t0 + q_len], b["v"][t0:t0 + q_len]
        if case.kv_dtype is not None:  # this step's k/v are read back from fp8 pages too
            new_k = kv_load(case, kv_store(case, new_k / (case.k_scale or 1.0)), case.k_scale)
            new_v = kv_load(case, kv_store(case, new_v / (case.v_scale or 1.0)), case.v_scale)
        kf = np.concatenate([b["hist_k"][s], new_k]).astype(np.float64)
        vf = np.concatenate([b["hist_v"][s], new_v]).astype(np.float64)
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


def expected_pages(case: Case, b, zero_tails: bool = True):
    """The input pages with this step's live k/v written at (page, slot), and (zero_tails)
    the slots past kv_len in each live sequence's last page zeroed."""
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
            if case.kv_dtype is None:
                k_exp[page, slot] = b["k"][t0 + i]
                v_exp[page, slot] = b["v"][t0 + i]
            else:
                k_exp[page, slot] = kv_store(case, b["k"][t0 + i] / (case.k_scale or 1.0))
                v_exp[page, slot] = kv_store(case, b["v"][t0 + i] / (case.v_scale or 1.0))
        t0 += q_len
        if not zero_tails:
            continue
        # The rest of the last page (slots past kv_len) is zeroed by the write.
        last = pi[s, (kv_len - 1) // case.page_size]
        k_exp[last, kv_len % case.page_size or case.page_size:] = 0
        v_exp[last, kv_len % case.page_size or case.page_size:] = 0
    return k_exp, v_exp, written


