"""The on-device sampler (the parameters it reads are `jaxinfer.engine.request.SamplingParams`).

Randomness is per request: the key for a request's n-th token is
fold_in(PRNGKey(seed), n), so a request with a seed gives the same output
whatever else shares its batch (and after a preemption).

The order of the logits processors follows vLLM: penalties (repetition on
prompt and output tokens, then frequency and presence on output tokens), then
temperature, top-k, top-p and min-p. Penalties apply to greedy rows too.
Logprobs are those of the raw model distribution (log-softmax of the logits
before any processing), as vLLM returns by default.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.request import SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Per-sequence sampling settings on the device, all [S]."""

    temperature: jax.Array  # f32
    top_k: jax.Array  # int32, 0 = off
    top_p: jax.Array  # f32
    min_p: jax.Array  # f32
    repetition_penalty: jax.Array  # f32
    presence_penalty: jax.Array  # f32
    frequency_penalty: jax.Array  # f32
    seeds: jax.Array  # int32
    steps: jax.Array  # int32: tokens generated so far (the sampling key's counter)

    @staticmethod
    def build(params: list[SamplingParams | None], seeds, steps, size: int) -> SamplingTensors:
        """Host-side (numpy): rows past len(params), or None rows, are greedy padding."""
        n = len(params)
        # One row of floats per sequence, then one conversion: numpy item writes, six a
        # sequence, were most of this function's time.
        floats = np.zeros((size, len(_FLOAT_FIELDS)), np.float32)
        floats[:] = _GREEDY_ROW
        top_k = np.zeros(size, np.int32)
        # (identity, not ==: a dataclass's == builds two tuples of its fields)
        if n and all(map(operator.is_, params, itertools.repeat(params[0]))):
            # one settings object for the batch (`LLM.generate`'s, the benchmarks')
            p = params[0]
            floats[:n] = _GREEDY_ROW if p is None else _float_row(p)
            top_k[:n] = 0 if p is None else max(p.top_k, 0)
        elif n:
            floats[:n] = [_GREEDY_ROW if p is None else _float_row(p) for p in params]
            top_k[:n] = [0 if p is None else max(p.top_k, 0) for p in params]
        arrays = {name: floats[:, i].copy() for i, name in enumerate(_FLOAT_FIELDS)}
        arrays["top_k"] = top_k
        for name, values in (("seeds", seeds), ("steps", steps)):
            arrays[name] = np.zeros(size, np.int32)
            arrays[name][:len(values)] = values
        return SamplingTensors(**arrays)

    def filters(self) -> bool:
        """Host-side (numpy): whether a sampled row (temperature > 0) keeps only some tokens
        (top_k, top_p or min_p set): what `sample`'s `filtered` must be for this batch."""
        filtering = (self.top_k > 0) | (self.top_p < 1) | (self.min_p > 0)
        return bool(np.any(filtering & (self.temperature > 0)))


# The float settings of a row, and a greedy row's (padding, or params None).
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")
_GREEDY_ROW = (0.0, 1.0, 0.0, 1.0, 0.0, 0.0)
_float_row = operator.attrgetter(*_FLOAT_FIELDS)


def token_counts(history, num_prompt, vocab: int):
    """history [S, L] int32 (prompt then output ids, -1 = padding); num_prompt [S] ->
    (seen [S, V] bool: in prompt or output, output_counts [S, V] int32)."""
    S, L = history.shape
    valid = history >= 0
    ids = jnp.where(valid, history, vocab)  # out of range: dropped
    rows = jnp.broadcast_to(jnp.arange(S)[:, None], (S, L))
    is_output = valid & (jnp.arange(L)[None, :] >= num_prompt[:, None])
    seen = jnp.zeros((S, vocab), bool).at[rows, ids].set(True, mode="drop")
    counts = jnp.zeros((S, vocab), jnp.int32).at[rows, ids].add(
        is_output.astype(jnp.int32), mode="drop")
    return seen, counts


def apply_penalties(logits, t: SamplingTensors, seen, output_counts):
    """vLLM's penalties: repetition divides positive (multiplies negative) logits of every
    seen token; frequency subtracts count * penalty, presence a flat penalty per output token."""
    rp = t.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    counts = output_counts.astype(logits.dtype)
    logits = logits - t.frequency_penalty[:, None] * counts
    return logits - t.presence_penalty[:, None] * (counts > 0)


def sample(logits, t: SamplingTensors, seen=None, output_counts=None,
           skip_draw: bool = True, filtered: bool = True):
    """logits [S, V] f32 -> token ids [S] int32.

    seen / output_counts (from token_counts) turn the penalties on. Rows with
    temperature 0 take the argmax. Others: scale by temperature, keep the top_k
    highest (0 = all), then the smallest set whose probability reaches top_p, then
    the tokens with probability >= min_p * the highest, and draw from what is left.
    filtered False (static): no row of the batch sets top_k, top_p or min_p
    (`SamplingTensors.filters`), so the draw takes the whole distribution and skips the
    vocabulary sort the filters need (~3 ms a step at 256 sequences of a 128k vocabulary).
    skip_draw: a batch with no sampled row skips the vocabulary sort, through a
    conditional. On GPUs XLA reads a conditional's predicate back to the host, which makes
    a step's launch wait for the whole forward pass before it; so the runner's one-step
    programs take `greedy_tokens` and run this in a program of its own only for batches
    that sample, and its multi-step decode loop draws every step there (bench/NOTES.md,
    Serving engine decode loop).
    """
    if seen is not None:
        logits = apply_penalties(logits, t, seen, output_counts)
    greedy = greedy_tokens(logits, t)
    draw = functools.partial(_draw, filtered=filtered)
    if skip_draw:
        drawn = jax.lax.cond(jnp.any(t.temperature > 0), draw, lambda *_: greedy, logits, t)
    else:
        drawn = draw(logits, t)
    return jnp.where(t.temperature > 0, drawn, greedy)


def greedy_tokens(logits, t: SamplingTensors, seen=None, output_counts=None):
    """What `sample` gives a batch whose rows all have temperature 0: the argmax of the
    logits, after the penalties (seen / output_counts) where given."""
    if seen is not None:
        logits = apply_penalties(logits, t, seen, output_counts)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _draw(logits, t: SamplingTensors, filtered: bool):
    scaled = logits / jnp.where(t.temperature > 0, t.temperature, 1.0)[:, None]
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(t.seeds, t.steps)
    if not filtered:
        return jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]
    vocab = logits.shape[-1]
    k = jnp.where(t.top_k > 0, jnp.minimum(t.top_k, vocab), vocab)
    in_top_k = jnp.arange(vocab)[None, :] < k[:, None]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    probs = jnp.where(in_top_k, probs, 0.0)
    probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    # Keep token i of the sorted list if the mass before it is < top_p, and if its
    # probability is at least min_p times the highest.
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < t.top_p[:, None]) & in_top_k
    keep &= probs >= t.min_p[:, None] * probs[:, :1]
    num_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)  # <= k
    threshold = jnp.take_along_axis(sorted_logits, (num_keep - 1)[:, None], axis=-1)
    masked = jnp.where(scaled >= threshold, scaled, -jnp.inf)
    return jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)


def logprobs_of(logits, tokens, num_top: int):
    """Raw-model logprobs: (of tokens [S] f32, top ids [S, num_top] int32, top logprobs).
    A logit minus its row's log-sum-exp, for the logits kept only: XLA's fused log_softmax
    gave a row other bits with the number of rows on an H100, its log-sum-exp did not
    (bench/NOTES.md, Batch invariance)."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1) - lse
    top_logits, top_ids = jax.lax.top_k(logits, num_top)
    return chosen[:, 0], top_ids.astype(jnp.int32), top_logits - lse
