"""Sampling parameters and the on-device sampler.

Randomness is per request: the key for a request's n-th token is
fold_in(PRNGKey(seed), n), so a request with a seed gives the same output
whatever else shares its batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.errors import JaxinferError


@dataclasses.dataclass
class SamplingParams:
    """Like vLLM's: temperature 0 is greedy; top_k 0 (or -1) and top_p 1 disable those filters."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        if self.temperature < 0:
            raise JaxinferError(f"temperature={self.temperature}: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise JaxinferError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.top_k < -1:
            raise JaxinferError(f"top_k={self.top_k}: must be -1, 0 or positive")
        if self.max_tokens < 1:
            raise JaxinferError(f"max_tokens={self.max_tokens}: must be >= 1")


def sample(logits, temperature, top_k, top_p, seeds, steps):
    """logits [S, V] f32; temperature, top_p [S] f32; top_k, seeds, steps [S] int32 -> ids [S].

    Rows with temperature 0 take the argmax. Others: scale by temperature, keep
    the top_k highest (0 = all), then the smallest set whose probability reaches
    top_p, and draw from what is left. An all-greedy batch skips the vocabulary sort.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    drawn = jax.lax.cond(jnp.any(temperature > 0), _draw, lambda *_: greedy,
                         logits, temperature, top_k, top_p, seeds, steps)
    return jnp.where(temperature > 0, drawn, greedy)


def _draw(logits, temperature, top_k, top_p, seeds, steps):
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]
    vocab = logits.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    probs = jnp.where(jnp.arange(vocab)[None, :] < k[:, None], probs, 0.0)
    probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    # Keep token i of the sorted list if the mass before it is < top_p.
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < top_p[:, None]) & (jnp.arange(vocab)[None, :] < k[:, None])
    num_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)  # <= k
    threshold = jnp.take_along_axis(sorted_logits, (num_keep - 1)[:, None], axis=-1)
    masked = jnp.where(scaled >= threshold, scaled, -jnp.inf)
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(seeds, steps)
    return jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)
