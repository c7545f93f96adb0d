"""Rotary position embeddings and the per-head q / k RMSNorm: the q / k prologue of attention.

RoPE follows HF's convention: inverse frequencies [D / 2] (`rope_inv_freq`, with the config's
`rope_scaling`: linear, llama3, yarn), tables cos / sin [T, D] holding the frequencies twice
(`rope_tables`), and `rotate_half` on the two halves of a head, not on pairs (`apply_rope`).
qk_norm models (Qwen3) RMS-normalise each q and k head over its D values before RoPE.

`QKPrologue` bundles both for one step's tokens. The model hands it to
`ragged_paged_attention` with q / k as the projections gave them: the registry applies it
with XLA (`QKPrologue.apply`) before an implementation that does not fuse it, and passes it
to one that does (the one-token Pallas GPU kernel, whose in-kernel form is checked against
the same float64 oracle in tests/test_attention.py).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.ops.registry import row_local


def rope_inv_freq(config: ModelConfig) -> tuple[jax.Array, float]:
    """Inverse frequencies [head_dim // 2] float32 and the attention scaling for the config's
    RoPE (`rope_theta`, `rope_scaling`: default, linear, llama3 or yarn)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    scaling = dict(config.rope_scaling or {})
    kind = scaling.get("rope_type", "default")
    attention_factor = 1.0
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = jnp.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        is_medium = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv_freq = jnp.where(is_medium, smoothed, inv_freq)
    elif kind == "yarn":
        factor = scaling["factor"]
        old_ctx = scaling.get("original_max_position_embeddings", config.max_position_embeddings)
        beta_fast, beta_slow = scaling.get("beta_fast", 32), scaling.get("beta_slow", 1)

        def correction_dim(rotations):
            return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (
                2 * math.log(config.rope_theta))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if scaling.get("truncate", True):  # gpt-oss keeps the fractional range
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low)
                        / (high - low if high != low else 1e-3), 0, 1)
        extrapolation = 1 - ramp
        inv_freq = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
        attention_factor = scaling.get("attention_factor") or (0.1 * math.log(factor) + 1.0)
    return inv_freq, attention_factor


def rope_tables(positions, inv_freq, attention_factor: float, dtype):
    """positions [T], inv_freq [D // 2] float32 -> (cos, sin) [T, D] in dtype, scaled by the
    attention factor: RoPE's rotation of each token (HF's convention: the frequencies twice).
    Every layer uses the same tables, so XLA computes them once per step."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return ((jnp.cos(emb) * attention_factor).astype(dtype),
            (jnp.sin(emb) * attention_factor).astype(dtype))


def apply_rope(x, cos, sin):
    """x [T, H, D] rotated by the tables cos / sin [T, D] (`rope_tables`; HF `rotate_half`
    convention: halves, not pairs), in x's dtype."""
    # rotate_half(x) = [-x2, x1], as a reverse of the two halves rather than a concatenate:
    # XLA fuses the reverse into its consumers, where the concatenate ran as a kernel of its
    # own per layer at batch 1 (bench/NOTES.md, Serving engine decode loop: rotate_half as a
    # reverse of the two halves).
    halves = x.reshape(*x.shape[:-1], 2, x.shape[-1] // 2)
    sign = jnp.array([-1, 1], x.dtype)[:, None]
    rotated = (halves[..., ::-1, :] * sign).reshape(x.shape)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def inverse_rms(x32, eps: float):
    """x32 [..., D] float32 -> 1 / sqrt(mean(x^2) + eps) over its last axis, [..., 1]
    (`RowNorm`: its sums of squares row local)."""
    return RowNorm.of(x32, eps).inverse()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowNorm:
    """An RMSNorm's statistic of each token, for a kernel that computes its 1 / rms itself:

      sum_sq  [..., 1] float32: the sum of x^2 over the token's `dim` features
      dim     static int, eps static float: 1 / rms = rsqrt(sum_sq / dim + eps)

    Why not 1 / rms itself: the reduction that gives sum_sq is fused with the residual add
    before it, and XLA runs the rsqrt after it as a kernel of its own wherever a custom
    kernel reads the result (bench/NOTES.md, Ragged paged attention: the input norm's
    rsqrt in the write kernel)."""

    sum_sq: jax.Array
    dim: int = dataclasses.field(metadata=dict(static=True))
    eps: float = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def of(cls, x32, eps: float) -> RowNorm:
        """x32 [..., dim] float32 -> its rows' statistic, row local (`row_local`): XLA:CPU
        reduces a row in one order below 8 rows and in another from 8 on, and fused with
        other work its order may change with the program."""
        return cls(row_local(lambda x: jnp.sum(x * x, axis=-1, keepdims=True), x32),
                   x32.shape[-1], eps)

    def inverse(self):
        """1 / rms [..., 1] float32 (mean(x^2) = sum_sq / dim)."""
        return jax.lax.rsqrt(self.sum_sq / self.dim + self.eps)


def scale_normed(x32, inv, scale, dtype):
    """The RMSNorm of x32 [..., D] float32 given its `inverse_rms` inv: x / rms(x) rounded to
    dtype, times the norm's scale [D] (as `models.layers.RMSNorm`: scale * (x / rms(x))). With
    scale in dtype the product is in dtype; with a float32 scale it is float32, the same value
    before its rounding to dtype."""
    return scale * (x32 * inv).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QKPrologue:
    """What turns the q / k / v projections into attention's q / k / v: the input norm's row
    scale (a `FoldedRMSNorm`'s 1 / rms, when the projection left it out), then, for q and k,
    an RMSNorm over each head (qk_norm models: Qwen3; q_norm / k_norm None: none) and RoPE
    at each token's position.

      cos, sin   [T, D]         RoPE's tables for the step's tokens (`rope_tables`), q's dtype
      q_norm     [D]            the q norm's scale (in q's dtype), or None
      k_norm     [D]            the k norm's scale, or None
      eps                       static float: the norms' eps
      row_norm   a `RowNorm` or None: each token's projections are multiplied by its
                 1 / rms first, rounded to their dtype (`scale_rows`, as `linear`'s
                 row_scale)

    `ragged_paged_attention` applies it with XLA before an implementation (`scale_rows`,
    `apply`), except where the implementation fuses it (its registry entry's `fuses`): the
    Pallas GPU kernel at one token (batch-1 decode), where XLA's three small kernels a layer
    for it (the sums of squares, q's and k's norm + RoPE) took ~4 us (bench/NOTES.md, Ragged
    paged attention: q/k prologue in the kernel), and on Hopper's larger steps the Pallas GPU
    kernel that writes the pages and q in one pass (`pallas_kernels/kv_write_gpu.py`).
    """

    cos: jax.Array
    sin: jax.Array
    q_norm: jax.Array | None = None
    k_norm: jax.Array | None = None
    eps: float = dataclasses.field(default=1e-6, metadata=dict(static=True))
    row_norm: RowNorm | None = None

    def scale_rows(self, *xs):
        """Each x [T, ...] (the fused projection, or q, k, v) times the row norm's 1 / rms as
        `linear`'s epilogue does it: in float32, rounded to x's dtype. Identity without one."""
        if self.row_norm is None:
            return xs
        scale = self.row_norm.inverse()
        return tuple((x.astype(jnp.float32) * scale.reshape(
            (-1,) + (1,) * (x.ndim - 1))).astype(x.dtype) for x in xs)

    def apply(self, q, k):
        """q [T, Hq, D], k [T, Hkv, D] -> (q, k) normed and rotated, in their dtypes."""
        if self.q_norm is not None:
            # The sums of squares over q's and k's heads together: one reduction kernel at
            # decode, not two.
            x32 = jnp.concatenate([q, k], axis=1).astype(jnp.float32)
            inv = inverse_rms(x32, self.eps)
            hq = q.shape[1]
            q = scale_normed(q.astype(jnp.float32), inv[:, :hq], self.q_norm, q.dtype)
            k = scale_normed(k.astype(jnp.float32), inv[:, hq:], self.k_norm, k.dtype)
        return apply_rope(q, self.cos, self.sin), apply_rope(k, self.cos, self.sin)
