"""Shared decoder layers: RMSNorm, rotary embeddings, GQA attention, SwiGLU MLP.

Parameter names match the checkpoint keys written by `jaxinfer convert`
(e.g. `layers.3.attn.q_proj.weight`); linear weights are (out, in). The q/k/v/o
and gate/up/down projections may be quantized (`Linear.set_quantized`), adding
`...weight_scale` and `...weight_offset` keys.
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.attention import KV_PAGES_AXES, AttentionMetadata, ragged_paged_attention
from jaxinfer.config import ModelConfig
from jaxinfer.linear import linear
from jaxinfer.quant import QuantizedWeight
from jaxinfer.sharding import P, current_mesh, reduce_over, shard_map_logical

_init = nnx.initializers.normal(0.02)

# The Linear layers that may be quantized, by key inside `layers.{i}`; embeddings, the LM
# head, norms and biases always stay float.
QUANTIZABLE = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
               "mlp.experts.gate_up_proj", "mlp.experts.down_proj",
               "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj",
               "mlp.shared_expert.down_proj")
_QUANTIZABLE_WEIGHT = re.compile(
    r"layers\.\d+\.(?:" + "|".join(map(re.escape, QUANTIZABLE)) + r")\.weight")


def is_quantizable(key: str) -> bool:
    """Whether checkpoint key `key` is the weight of a projection that may be quantized."""
    return _QUANTIZABLE_WEIGHT.fullmatch(key) is not None


class Linear(nnx.Module):
    """weight [out, in] (+ bias [out]); or a quantized weight (see `set_quantized`).

    `axes` names the weight's logical axes (out, in), e.g. P("heads", "embed") for a
    column-split projection and P("embed", "heads") for the row-split one after it (see
    `jaxinfer.sharding`). A quantized layer holds the parts of a `QuantizedWeight` as
    parameters, under the checkpoint keys `weight` (values [N, K] int8 / int4 /
    float8_e4m3fn), `weight_scale` (scales [K // g, N] float32) and `weight_offset`
    (offsets like the scales, or None), with `activations` ("fp8": W8A8) static.
    """

    def __init__(self, in_features, out_features, *, axes: P, bias, dtype, rngs: nnx.Rngs,
                 num_experts: int = 0):
        stack = (num_experts,) if num_experts else ()  # a stack of expert layers (MoE)
        self.weight = nnx.Param(_init(rngs.params(), (*stack, out_features, in_features),
                                      dtype), axes=axes)
        self.bias = (nnx.Param(jnp.zeros((*stack, out_features), dtype), axes=P(*axes[:-1]))
                     if bias else None)
        self.weight_scale = nnx.data(None)
        self.weight_offset = nnx.data(None)
        self.activations = None

    @property
    def axes(self) -> P:
        return self.weight.get_metadata()["axes"]

    @property
    def quantized(self) -> bool:
        return self.weight_scale is not None

    def set_quantized(self, w: QuantizedWeight):
        """Turns this layer into a quantized one holding `w` (W of the same [out, in] shape)."""
        if tuple(w.shape) != tuple(self.weight.shape):
            raise ValueError(f"set_quantized: weight {tuple(w.shape)}, layer "
                             f"{tuple(self.weight.shape)}")
        axes = self.axes
        *stack, n, k = axes
        self.weight = nnx.Param(w.values, axes=axes)
        self.weight_scale = nnx.Param(w.scales, axes=P(*stack, k, n))
        self.weight_offset = (None if w.offsets is None
                              else nnx.Param(w.offsets, axes=P(*stack, k, n)))
        self.activations = w.activations

    def quantized_weight(self) -> QuantizedWeight:
        offset = None if self.weight_offset is None else self.weight_offset[...]
        return QuantizedWeight(self.weight[...], self.weight_scale[...], offset, self.activations)

    def weight_and_axes(self):
        """(the float weight or QuantizedWeight, a matching pytree of logical axes)."""
        if not self.quantized:
            return self.weight[...], self.axes
        w = self.quantized_weight()
        *stack, n, k = self.axes
        parts = P(*stack, k, n)
        return w, QuantizedWeight(self.axes, parts, None if w.offsets is None else parts,
                                  w.activations)

    def __call__(self, x):
        bias = None if self.bias is None else self.bias[...]
        w, w_axes = self.weight_and_axes()
        if current_mesh() is None:
            return linear(x, w, bias)
        # On a mesh each device multiplies by its shard (the same dot, or kernel, as on one
        # device); a split `in` axis leaves partial sums, which one psum joins: the one
        # all-reduce of a column-split -> row-split block.
        out_axis, in_axis = self.axes
        lead = (None,) * (x.ndim - 1)
        in_features = x.shape[-1]

        def local(x, w, *bias):
            bias = bias[0] if bias else None
            if x.shape[-1] == in_features:
                return linear(x, w, bias)
            y = reduce_over((in_axis,), linear(x, w))
            if bias is None:
                return y
            return (y.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)

        args, axes = (x, w), (P(*lead, in_axis), w_axes)
        if bias is not None:
            args, axes = (*args, bias), (*axes, P(out_axis))
        return shard_map_logical(local, axes, P(*lead, out_axis), *args)


class RMSNorm(nnx.Module):
    """HF's order of operations: normalise in f32, cast back, then scale."""

    def __init__(self, dim, *, eps, dtype, axes: P | None = None):
        self.scale = nnx.Param(jnp.ones((dim,), dtype), axes=axes or P("embed"))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * x32.astype(x.dtype)


def rope_inv_freq(config: ModelConfig) -> tuple[jax.Array, float]:
    """Inverse frequencies [head_dim // 2] and the attention scaling for the config's RoPE."""
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


def apply_rope(x, positions, inv_freq, attention_factor=1.0):
    """x [T, H, D], positions [T] -> x rotated (HF `rotate_half` convention: halves, not pairs)."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos = (jnp.cos(emb) * attention_factor).astype(x.dtype)[:, None, :]
    sin = (jnp.sin(emb) * attention_factor).astype(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


class Attention(nnx.Module):
    """GQA attention over the paged KV cache; layer `layer` of the config (its window)."""

    def __init__(self, config: ModelConfig, *, layer: int = 0, dtype, rngs: nnx.Rngs):
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.q_proj = Linear(c.hidden_size, q_size, axes=P("heads", "embed"), bias=c.qkv_bias,
                             dtype=dtype, rngs=rngs)
        self.k_proj = Linear(c.hidden_size, kv_size, axes=P("kv_heads", "embed"),
                             bias=c.qkv_bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(c.hidden_size, kv_size, axes=P("kv_heads", "embed"),
                             bias=c.qkv_bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(q_size, c.hidden_size, axes=P("embed", "heads"), bias=c.o_bias,
                             dtype=dtype, rngs=rngs)
        if c.qk_norm:
            norm = dict(eps=c.rms_norm_eps, dtype=dtype, axes=P("head_dim"))
            self.q_norm, self.k_norm = RMSNorm(c.head_dim, **norm), RMSNorm(c.head_dim, **norm)
        else:
            self.q_norm = self.k_norm = None
        # gpt-oss: a learned logit per query head joins each softmax's denominator.
        self.sinks = (nnx.Param(jnp.zeros((c.num_heads,), dtype), axes=P("heads"))
                      if c.attention_sinks else None)
        self.sliding_window = c.layer_window(layer)
        self.config = c

    def __call__(self, x, positions, kv_pages, md: AttentionMetadata):
        T = x.shape[0]
        q = self.q_proj(x).reshape(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq, rope_factor = rope_inv_freq(self.config)  # constants under jit
        q = apply_rope(q, positions, inv_freq, rope_factor)
        k = apply_rope(k, positions, inv_freq, rope_factor)
        attend = functools.partial(ragged_paged_attention, sm_scale=self.head_dim ** -0.5,
                                   sliding_window=self.sliding_window)
        heads, kv_heads = P("batch", "heads", "head_dim"), P("batch", "kv_heads", "head_dim")
        pages = KV_PAGES_AXES
        sinks = None if self.sinks is None else self.sinks[...]
        # The kernel runs per device on its heads (and the KV heads they read).
        out, k_pages, v_pages = shard_map_logical(
            lambda q, k, v, kp, vp, md, sinks: attend(q, k, v, kp, vp, md, sinks=sinks),
            (heads, kv_heads, kv_heads, pages, pages, P(), P("heads")), (heads, pages, pages),
            q, k, v, *kv_pages, md, sinks)
        return self.o_proj(out.reshape(T, -1)), (k_pages, v_pages)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), of `intermediate_size` (default: the config's)."""

    def __init__(self, config: ModelConfig, *, intermediate_size: int | None = None, dtype,
                 rngs: nnx.Rngs):
        c = config
        i = intermediate_size or c.intermediate_size
        column, row = P("mlp", "embed"), P("embed", "mlp")
        self.gate_proj = Linear(c.hidden_size, i, axes=column, bias=c.mlp_bias, dtype=dtype,
                                rngs=rngs)
        self.up_proj = Linear(c.hidden_size, i, axes=column, bias=c.mlp_bias, dtype=dtype,
                              rngs=rngs)
        self.down_proj = Linear(i, c.hidden_size, axes=row, bias=c.mlp_bias, dtype=dtype,
                                rngs=rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
