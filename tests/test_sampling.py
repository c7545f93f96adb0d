"""`sample()` and `SamplingParams` validation; expected sets and distributions come from NumPy."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from jaxinfer.engine.request import SamplingParams
from jaxinfer.engine.sampling import SamplingTensors, logprobs_of, sample, token_counts
from jaxinfer.errors import JaxinferError

_sample = jax.jit(sample)


def tensors(S, temperature=0.0, top_k=0, top_p=1.0, seeds=0, steps=0, min_p=0.0,
            repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0):
    """SamplingTensors with each setting broadcast to [S]."""
    def vec(x, dt):
        return np.broadcast_to(np.asarray(x, dt), (S,)).copy()

    f, i = np.float32, np.int32
    return SamplingTensors(
        temperature=vec(temperature, f), top_k=vec(top_k, i), top_p=vec(top_p, f),
        min_p=vec(min_p, f), repetition_penalty=vec(repetition_penalty, f),
        presence_penalty=vec(presence_penalty, f), frequency_penalty=vec(frequency_penalty, f),
        seeds=vec(seeds, i), steps=vec(steps, i))


def draw(logits, temperature, top_k, top_p, seeds, steps, min_p=0.0):
    """Broadcasts scalars to [S] and calls the sampler; returns numpy int ids [S]."""
    logits = np.asarray(logits, np.float32)
    S = logits.shape[0]
    ids = _sample(logits, tensors(S, temperature, top_k, top_p, seeds, steps, min_p))
    assert ids.shape == (S,) and ids.dtype == np.int32
    ids = np.asarray(ids)
    assert ((ids >= 0) & (ids < logits.shape[1])).all()
    return ids


def softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def allowed_probs(logits, temperature, top_k, top_p):
    """NumPy spec: the distribution sampled from (float64) for one row."""
    p = softmax(np.asarray(logits, np.float64) / temperature)
    order = np.argsort(-p, kind="stable")
    k = len(p) if top_k <= 0 else min(top_k, len(p))
    keep = np.zeros(len(p), bool)
    keep[order[:k]] = True
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    # Smallest prefix of the sorted (renormalized) list whose mass reaches top_p.
    cum = np.cumsum(q[order[:k]])
    n = int(np.searchsorted(cum, top_p - 1e-12)) + 1
    n = min(n, k)
    keep = np.zeros(len(p), bool)
    keep[order[:n]] = True
    q = np.where(keep, q, 0.0)
    return q / q.sum()


def logits_clear_of_top_p(rng, vocab, top_p, temperature=1.0, top_k=0, margin=0.02):
    """Random logits whose cumulative sorted mass is not within `margin` of top_p
    (so float32 rounding cannot decide the boundary)."""
    for _ in range(1000):
        x = rng.standard_normal(vocab) * 2.0
        p = softmax(x / temperature)
        if top_k > 0:
            srt = np.sort(p)[::-1][:top_k]
            srt = srt / srt.sum()
        else:
            srt = np.sort(p)[::-1]
        cum = np.cumsum(srt)[:-1]  # the full mass (1.0) always reaches top_p <= 1
        if cum.size == 0 or np.abs(cum - top_p).min() > margin:
            return x.astype(np.float32)
    raise AssertionError("could not draw logits")


def test_greedy_rows_are_argmax():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((64, 100)).astype(np.float32) * 3
    top_k = rng.integers(0, 10, 64)
    top_p = rng.uniform(0.1, 1.0, 64)
    ids = draw(logits, 0.0, top_k, top_p, np.arange(64), rng.integers(0, 100, 64))
    np.testing.assert_array_equal(ids, logits.argmax(-1))


def test_greedy_rows_in_mixed_batch():
    rng = np.random.default_rng(1)
    S = 64
    logits = rng.standard_normal((S, 50)).astype(np.float32)
    temperature = np.where(np.arange(S) % 2 == 0, 0.0, 5.0).astype(np.float32)
    ids = draw(logits, temperature, 0, 1.0, np.arange(S), 0)
    greedy = temperature == 0
    np.testing.assert_array_equal(ids[greedy], logits[greedy].argmax(-1))
    # The hot rows really sample (at temperature 5 over 50 near-flat tokens most are not argmax).
    assert (ids[~greedy] != logits[~greedy].argmax(-1)).sum() > S // 4


@pytest.mark.parametrize("temperature", [0.3, 1.0, 10.0])
def test_top_k_1_is_argmax(temperature):
    rng = np.random.default_rng(2)
    S = 128
    logits = rng.standard_normal((S, 40)).astype(np.float32)
    ids = draw(logits, temperature, 1, 1.0, np.arange(S), np.arange(S) * 7)
    np.testing.assert_array_equal(ids, logits.argmax(-1))


@pytest.mark.parametrize("k", [2, 5, 17])
def test_top_k_draws_within_top_k(k):
    rng = np.random.default_rng(3 + k)
    vocab, S = 64, 1024
    row = rng.standard_normal(vocab).astype(np.float32)
    logits = np.tile(row, (S, 1))
    ids = draw(logits, 3.0, k, 1.0, np.arange(S), 5)
    top = set(np.argsort(-row)[:k].tolist())
    outside = sorted(set(ids.tolist()) - top)
    assert not outside, f"drawn outside top-{k}: {outside}"
    # Not vacuous: at temperature 3 every one of the k tokens shows up.
    assert set(ids.tolist()) == top


def test_top_k_per_row():
    rng = np.random.default_rng(4)
    vocab, S = 32, 512
    logits = rng.standard_normal((S, vocab)).astype(np.float32)
    top_k = rng.integers(1, 6, S)
    ids = draw(logits, 2.0, top_k, 1.0, np.arange(S), 0)
    rank = (logits > logits[np.arange(S), ids][:, None]).sum(-1)  # 0 = the highest
    assert (rank < top_k).all(), np.argwhere(rank >= top_k)[:5].ravel()


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.9])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_top_p_draws_within_nucleus(top_p, temperature):
    rng = np.random.default_rng(int(top_p * 100) + int(temperature))
    vocab, S = 32, 1024
    row = logits_clear_of_top_p(rng, vocab, top_p, temperature, margin=0.005)
    spec = allowed_probs(row, temperature, 0, top_p)
    nucleus = set(np.flatnonzero(spec > 0).tolist())
    assert len(nucleus) < vocab
    ids = draw(np.tile(row, (S, 1)), temperature, 0, top_p, np.arange(S), 3)
    outside = sorted(set(ids.tolist()) - nucleus)
    assert not outside, (f"top_p={top_p} T={temperature}: nucleus {sorted(nucleus)}, "
                         f"drew {outside} ({np.isin(ids, outside).sum()} of {S} draws)")


@pytest.mark.parametrize("top_k,top_p", [(8, 0.5), (3, 0.95), (20, 0.7)])
def test_top_k_then_top_p(top_k, top_p):
    rng = np.random.default_rng(top_k)
    vocab, S = 48, 1024
    row = logits_clear_of_top_p(rng, vocab, top_p, 1.0, top_k)
    spec = allowed_probs(row, 1.0, top_k, top_p)
    allowed = set(np.flatnonzero(spec > 0).tolist())
    ids = draw(np.tile(row, (S, 1)), 1.0, top_k, top_p, np.arange(S), 0)
    outside = sorted(set(ids.tolist()) - allowed)
    assert not outside, f"allowed {sorted(allowed)}, drew {outside}"


def test_top_p_1_and_top_k_0_do_not_filter():
    """With the filters off, a near-flat distribution reaches every token."""
    vocab, S = 8, 2000
    row = np.linspace(0, 0.5, vocab).astype(np.float32)
    ids = draw(np.tile(row, (S, 1)), 1.0, 0, 1.0, np.arange(S), 0)
    assert set(ids.tolist()) == set(range(vocab))
    ids = draw(np.tile(row, (S, 1)), 1.0, -1, 1.0, np.arange(S), 0)
    assert set(ids.tolist()) == set(range(vocab))


def test_same_seed_and_step_is_deterministic():
    rng = np.random.default_rng(5)
    S, vocab = 256, 100
    logits = rng.standard_normal((S, vocab)).astype(np.float32)
    seeds = rng.integers(0, 2**31 - 1, S)
    steps = rng.integers(0, 1000, S)
    a = draw(logits, 1.5, 0, 1.0, seeds, steps)
    b = draw(logits, 1.5, 0, 1.0, seeds, steps)
    np.testing.assert_array_equal(a, b)
    # Per request: a row's token does not depend on the rest of the batch.
    perm = rng.permutation(S)
    c = draw(logits[perm], 1.5, 0, 1.0, seeds[perm], steps[perm])
    np.testing.assert_array_equal(c, a[perm])
    single = np.array([draw(logits[i:i + 1], 1.5, 0, 1.0, seeds[i], steps[i])[0]
                       for i in range(8)])
    np.testing.assert_array_equal(single, a[:8])


def test_different_steps_and_seeds_give_different_draws():
    S, vocab = 512, 64
    logits = np.zeros((S, vocab), np.float32)  # uniform: two independent draws agree ~1/64
    seeds = np.arange(S)
    a = draw(logits, 1.0, 0, 1.0, seeds, 0)
    b = draw(logits, 1.0, 0, 1.0, seeds, 1)
    assert (a == b).mean() < 0.1, (a == b).mean()
    # Same seed for every row, different steps: different tokens too.
    c = draw(logits, 1.0, 0, 1.0, 42, np.arange(S))
    assert len(set(c.tolist())) > vocab // 2
    # Different seeds, same step.
    d = draw(logits, 1.0, 0, 1.0, seeds + 1000, 0)
    assert (a == d).mean() < 0.1
    assert len(set(a.tolist())) > vocab // 2


def chi_square(ids, probs):
    n = len(ids)
    counts = np.bincount(ids, minlength=len(probs))
    support = probs > 0
    outside = np.flatnonzero(counts * ~support)
    assert counts[~support].sum() == 0, f"draws outside support: {outside}"
    exp = n * probs[support]
    return float(((counts[support] - exp) ** 2 / exp).sum()), int(support.sum()) - 1


# chi-square 99.9% quantiles by degrees of freedom (fixed seeds: deterministic anyway).
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (2.0, 0, 1.0), (1.0, 4, 1.0), (1.0, 0, 0.8), (1.5, 5, 0.9),
])
def test_frequencies_match_softmax(temperature, top_k, top_p):
    rng = np.random.default_rng(7)
    vocab, n = 6, 2000
    row = logits_clear_of_top_p(rng, vocab, top_p, temperature, top_k, margin=0.03)
    probs = allowed_probs(row, temperature, top_k, top_p)
    assert (probs > 0).sum() >= 2
    ids = draw(np.tile(row, (n, 1)), temperature, top_k, top_p, 1234, np.arange(n))
    stat, dof = chi_square(ids, probs)
    assert stat < CHI2_999[dof], (stat, dof, np.bincount(ids, minlength=vocab) / n, probs)


def test_chi_square_detects_wrong_distribution():
    """The check above is not toothless: the right draws fail against a wrong temperature."""
    rng = np.random.default_rng(7)
    vocab, n = 6, 2000
    row = rng.standard_normal(vocab).astype(np.float32) * 2
    ids = draw(np.tile(row, (n, 1)), 1.0, 0, 1.0, 1234, np.arange(n))
    assert chi_square(ids, allowed_probs(row, 1.0, 0, 1.0))[0] < CHI2_999[5]
    assert chi_square(ids, allowed_probs(row, 2.0, 0, 1.0))[0] > CHI2_999[5]


_sample_whole = jax.jit(functools.partial(sample, filtered=False))


@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.0])
def test_the_draw_without_filters_matches_softmax(temperature):
    """`filtered=False` (no row sets top_k, top_p or min_p: no vocabulary sort) draws from
    the whole softmax, and for the same keys the tokens of the sorted draw, greedy rows
    left alone."""
    vocab, n = 6, 2000  # a fixed row: the chi-square bound would fail 0.1% of fresh ones
    row = (np.random.default_rng(13).standard_normal(vocab) * 2).astype(np.float32)
    t = tensors(n, temperature, 0, 1.0, 1234, np.arange(n))
    ids = np.asarray(_sample_whole(np.tile(row, (n, 1)), t))
    stat, dof = chi_square(ids, allowed_probs(row, temperature, 0, 1.0))
    assert stat < CHI2_999[dof], (stat, np.bincount(ids, minlength=vocab) / n)
    rng = np.random.default_rng()
    S, vocab = 256, 1000
    logits = (rng.standard_normal((S, vocab)) * 3).astype(np.float32)
    temps = np.where(rng.random(S) < 0.25, 0.0, temperature).astype(np.float32)
    t = tensors(S, temps, 0, 1.0, rng.integers(0, 2**31 - 1, S), rng.integers(0, 999, S))
    whole = np.asarray(_sample_whole(logits, t))
    np.testing.assert_array_equal(whole, np.asarray(_sample(logits, t)))
    np.testing.assert_array_equal(whole[temps == 0], logits[temps == 0].argmax(-1))
    assert (whole[temps > 0] != logits[temps > 0].argmax(-1)).any()


def test_a_batch_filters_when_a_sampled_row_sets_a_filter():
    S = 4
    assert not tensors(S, 0.8).filters()
    assert not tensors(S, 0.0, top_k=5, top_p=0.5, min_p=0.1).filters()  # greedy rows
    for filters in (dict(top_k=5), dict(top_p=0.9), dict(min_p=0.05)):
        t = tensors(S, 0.8)
        for name, value in filters.items():
            getattr(t, name)[2] = value
        assert t.filters(), filters
        t.temperature[2] = 0.0
        assert not t.filters(), filters


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9])
def test_min_p_keeps_tokens_above_fraction_of_best(min_p):
    rng = np.random.default_rng(11)
    vocab, n = 8, 2000
    for _ in range(1000):  # no probability ratio within 3% of min_p
        row = (rng.standard_normal(vocab) * 1.5).astype(np.float32)
        p = softmax(row)
        if np.abs(p / p.max() - min_p).min() > 0.03:
            break
    p = softmax(row)
    expected = np.where(p >= min_p * p.max(), p, 0.0)
    expected /= expected.sum()
    ids = draw(np.tile(row, (n, 1)), 1.0, 0, 1.0, 99, np.arange(n), min_p=min_p)
    stat, dof = chi_square(ids, expected)
    if dof == 0:
        assert (ids == p.argmax()).all()
    else:
        assert stat < CHI2_999[dof], (stat, np.bincount(ids, minlength=vocab) / n, expected)


def numpy_penalized(logits, history, num_prompt, rep, presence, frequency):
    """vLLM's penalties, written out per row in float64."""
    out = np.asarray(logits, np.float64).copy()
    for s, row in enumerate(out):
        ids = [t for t in history[s] if t >= 0]
        for t in set(ids):
            row[t] = row[t] / rep[s] if row[t] > 0 else row[t] * rep[s]
        outputs = ids[num_prompt[s]:]
        for t in set(outputs):
            row[t] -= frequency[s] * outputs.count(t) + presence[s]
    return out


def test_penalties_match_numpy():
    rng = np.random.default_rng(5)
    S, vocab, L = 64, 40, 24
    logits = rng.standard_normal((S, vocab)).astype(np.float32) * 2
    history = rng.integers(0, vocab, (S, L)).astype(np.int32)
    lengths = rng.integers(1, L + 1, S)
    history[np.arange(L)[None, :] >= lengths[:, None]] = -1  # padding
    num_prompt = rng.integers(0, lengths + 1).astype(np.int32)
    rep = rng.choice([1.0, 0.7, 1.3, 2.0], S).astype(np.float32)
    presence = rng.uniform(-2, 2, S).astype(np.float32)
    frequency = rng.uniform(-2, 2, S).astype(np.float32)
    t = tensors(S, repetition_penalty=rep, presence_penalty=presence,
                frequency_penalty=frequency)
    seen, counts = jax.jit(token_counts, static_argnums=2)(history, num_prompt, vocab)
    expected = numpy_penalized(logits, history, num_prompt, rep, presence, frequency)
    # Greedy rows take the argmax of the penalised logits.
    ids = np.asarray(_sample(logits, t, seen, counts))
    np.testing.assert_array_equal(ids, expected.argmax(-1))
    # Without the penalty state the same rows take the plain argmax (the test can fail).
    plain = np.asarray(_sample(logits, t))
    assert (plain != ids).any()


def test_logprobs_are_raw_log_softmax():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((5, 300)).astype(np.float32) * 4
    tokens = rng.integers(0, 300, 5).astype(np.int32)
    chosen, top_ids, top_lp = jax.jit(logprobs_of, static_argnums=2)(logits, tokens, 20)
    x = logits.astype(np.float64)
    ref = x - x.max(-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    np.testing.assert_allclose(chosen, ref[np.arange(5), tokens], atol=1e-4)
    np.testing.assert_array_equal(top_ids, np.argsort(-ref, axis=-1)[:, :20])
    np.testing.assert_allclose(top_lp, np.sort(ref, axis=-1)[:, ::-1][:, :20], atol=1e-4)


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-0.1), dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=-0.5),
    dict(top_p=1.01), dict(top_p=2.0), dict(max_tokens=0), dict(max_tokens=-3), dict(top_k=-2),
    dict(min_p=-0.1), dict(min_p=1.5), dict(repetition_penalty=0.0),
    dict(presence_penalty=2.5), dict(frequency_penalty=-3.0), dict(logprobs=21),
    dict(logprobs=-1), dict(stop=[""]), dict(stop_token_ids=[-4]),
])
def test_sampling_params_rejects(kwargs):
    with pytest.raises(JaxinferError) as e:
        SamplingParams(**kwargs)
    assert next(iter(kwargs)) in str(e.value)


@pytest.mark.parametrize("kwargs", [
    dict(), dict(temperature=0.0), dict(top_p=1.0), dict(top_p=1e-3), dict(top_k=-1),
    dict(top_k=0), dict(top_k=50), dict(max_tokens=1), dict(temperature=2.0, seed=3),
])
def test_sampling_params_accepts(kwargs):
    p = SamplingParams(**kwargs)
    for k, v in kwargs.items():
        assert getattr(p, k) == v
