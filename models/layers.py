"""Shared decoder layers: RMSNorm, rotary embeddings, GQA attention, SwiGLU MLP.

Parameter names match the checkpoint keys written by `jaxinfer convert`
(e.g. `layers.3.attn.q_proj.weight`); linear weights are (out, in). The q/k/v/o
and gate/up/down projections may be quantized (`Linear.set_quantized`), adding
`...weight_scale` and `...weight_offset` keys. The model runner joins q/k/v and
gate/up into one projection each (`fuse_linears`) once the weights are placed, and
folds the RMSNorm scales in front of them into their float weights (`RMSNorm.fold_into`).
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.ops.attention import (
    KV_PAGES_AXES,
    AttentionMetadata,
    QKPrologue,
    ragged_paged_attention,
)
from jaxinfer.ops.linear import linear
from jaxinfer.ops.quant import QuantizedWeight
from jaxinfer.sharding import (
    P,
    current_mesh,
    join_per_shard_on_device,
    reduce_over,
    shard_map_logical,
)

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

    def __call__(self, x, row_scale=None):
        """x [..., in] -> [..., out]; `row_scale` [..., 1] f32: see `linear`."""
        bias = None if self.bias is None else self.bias[...]
        w, w_axes = self.weight_and_axes()
        if current_mesh() is None:
            return linear(x, w, bias, row_scale)
        # On a mesh each device multiplies by its shard (the same dot, or kernel, as on one
        # device); a split `in` axis leaves partial sums, which one psum joins: the one
        # all-reduce of a column-split -> row-split block.
        out_axis, in_axis = self.axes
        lead = (None,) * (x.ndim - 1)
        in_features = x.shape[-1]

        args, axes = [x, w], [P(*lead, in_axis), w_axes]
        for extra, extra_axes in ((bias, P(out_axis)), (row_scale, P(*lead, None))):
            if extra is not None:
                args.append(extra)
                axes.append(extra_axes)

        def local(x, w, *extras):
            extras = iter(extras)
            b = None if bias is None else next(extras)
            scale = None if row_scale is None else next(extras)
            if x.shape[-1] == in_features:
                return linear(x, w, b, scale)
            y = reduce_over((in_axis,), linear(x, w))
            if b is None and scale is None:
                return y
            y = y.astype(jnp.float32) * (1.0 if scale is None else scale)
            return (y if b is None else y + b.astype(jnp.float32)).astype(x.dtype)

        return shard_map_logical(local, tuple(axes), P(*lead, out_axis), *args)


def fuse_linears(parts: list[Linear]) -> tuple[Linear, tuple[int, ...]] | None:
    """One Linear computing every part's output side by side, in place of parts[0].

    The parts (same input, same format: float or one quantized format, bias or not) are
    joined along their out-features axis *per shard*: on a mesh that splits out-features in
    n shards, the fused rows are [a_0 b_0 c_0 | a_1 b_1 c_1 | ...], so each device's slice
    of the fused output holds its slices of every part (`split_columns` takes them apart
    without communication). Returns (the fused Linear, each part's out-features), or None
    when the parts differ in format or layout (they then stay separate).

    Why: fewer, larger GEMMs. Llama-8B batch-1 decode on an H200: gate_up as one GEMM took
    58.8 us where gate and up took 75 (bench/RESULTS.md, third session).
    """
    def tensors(layer: Linear):
        w = layer.quantized_weight() if layer.quantized else None
        return ([layer.weight[...]] if w is None else
                [w.values, w.scales] + ([] if w.offsets is None else [w.offsets]))

    def signature(layer: Linear):
        """All but the out-features: parts with equal signatures can be joined."""
        sig = [layer.quantized, layer.activations, layer.bias is not None]
        for i, t in enumerate(tensors(layer)):  # values [N, K]; scales, offsets [G, N]
            spec = (t.sharding.spec if isinstance(t.sharding, jax.sharding.NamedSharding)
                    else None)
            sig.append((t.dtype, t.shape[1:] if i == 0 else t.shape[:-1], spec))
        return tuple(sig)

    first = parts[0]
    if len({signature(lay) for lay in parts}) != 1 or len(first.axes) != 2:
        return None
    values = [tensors(lay)[0] for lay in parts]
    sizes = tuple(int(v.shape[0]) for v in values)
    shards = {v.shape[0] // v.sharding.shard_shape(v.shape)[0] for v in values}
    if len(shards) != 1:
        return None
    shards = shards.pop()
    # values join along axis 0, scales and offsets [G, N] along axis 1.
    joined = [join_per_shard_on_device(tuple(tensors(lay)[i] for lay in parts), min(i, 1),
                                       shards, t.sharding)
              for i, t in enumerate(tensors(first))]
    axes = first.axes
    first.weight = nnx.Param(joined[0], axes=axes)
    if first.quantized:
        parts_axes = P(axes[1], axes[0])
        first.weight_scale = nnx.Param(joined[1], axes=parts_axes)
        if len(joined) > 2:
            first.weight_offset = nnx.Param(joined[2], axes=parts_axes)
    if first.bias is not None:
        bias = first.bias[...]
        first.bias = nnx.Param(join_per_shard_on_device(
            tuple(lay.bias[...] for lay in parts), 0, shards, bias.sharding), axes=P(axes[0]))
    return first, sizes


def split_columns(y, sizes: tuple[int, ...], axis: str):
    """y [..., sum(sizes)] from a fused Linear (`fuse_linears`) -> one array per part, each
    [..., size], on a mesh split over the mesh axis of logical `axis` like y."""
    total = sum(sizes)

    def local(y):
        n = y.shape[-1]  # total / shards: this device's slice of every part
        return tuple(jnp.split(y, np.cumsum([s * n // total for s in sizes])[:-1], axis=-1))

    spec = P(*(None,) * (y.ndim - 1), axis)
    return shard_map_logical(local, (spec,), (spec,) * len(sizes), y)


class RMSNorm(nnx.Module):
    """HF's order of operations: normalise in f32, cast back, then scale.

    The runner folds a decoder layer's norms into the float projections they feed
    (`fold_into`); the layer then asks `prepare` for the projections' input.
    """

    def __init__(self, dim, *, eps, dtype, axes: P | None = None):
        self.scale = nnx.Param(jnp.ones((dim,), dtype), axes=axes or P("embed"))
        self.eps = eps
        self.folded = False  # static: the scale lives in the next projections' weights

    def inv_rms(self, x):
        """x [..., dim] -> 1 / rms(x) [..., 1] float32."""
        x32 = x.astype(jnp.float32)
        return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)

    def __call__(self, x):
        if self.folded:
            raise ValueError("RMSNorm: its scale was folded into a projection; use prepare")
        return self.scaled(x, self.inv_rms(x))

    def scaled(self, x, inv_rms):
        """The norm of x given its `inv_rms(x)` (computed elsewhere, e.g. with other rows)."""
        return self.scale[...] * (x.astype(jnp.float32) * inv_rms).astype(x.dtype)

    def prepare(self, x):
        """(the input of the projections this norm feeds, their row_scale): (self(x), None),
        or (x, 1 / rms(x)) once the scale is folded into their weights."""
        return (x, self.inv_rms(x)) if self.folded else (self(x), None)

    def fold_into(self, layers: list[Linear], keep_norm: bool = False) -> bool:
        """Multiplies the scale into the input columns of every layer's weight, in place, so
        that linear(x, W * scale, row_scale=1 / rms(x)) = linear(norm(x), W). Only when all
        are float (a quantized weight keeps its values); the runner calls it once. Returns
        whether it folded. keep_norm: the norm's own output is still read elsewhere (an
        MoE block's experts), so the norm keeps its scale and stays callable.

        Why: at batch 1 the normalised activations cost a kernel of their own before each
        projection (a reduce, then a multiply); with the scale in the weight, XLA fuses the
        multiply by 1 / rms into the kernels that already read the projection's output
        (split-K sums, RoPE, SiLU) (bench/NOTES.md, serving engine v4). In bf16 this rounds
        W * scale where HF rounds scale * normalised x: as accurate, not bit-identical.
        """
        if self.folded or any(lay.quantized or lay.weight[...].ndim != 2 for lay in layers):
            return False
        scale = self.scale[...]
        for lay in layers:
            w = lay.weight[...]
            lay.weight = nnx.Param(_scale_columns(w, scale, w.sharding), axes=lay.axes)
        self.folded = not keep_norm
        return True


@functools.partial(jax.jit, static_argnums=2)
def _scale_columns(w, scale, sharding):
    """w [N, K] * scale [K] in float32, back in w's dtype, placed like w (`sharding`)."""
    out = (w.astype(jnp.float32) * scale.astype(jnp.float32)[None, :]).astype(w.dtype)
    return jax.lax.with_sharding_constraint(out, sharding)


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
        self.qkv_proj, self.qkv_sizes = nnx.data(None), None  # see fuse_projections

    def fuse_projections(self):
        """q/k/v as one projection (`fuse_linears`), in place; the runner calls it once."""
        if self.qkv_proj is None and (fused := fuse_linears(
                [self.q_proj, self.k_proj, self.v_proj])):
            self.qkv_proj, self.qkv_sizes = fused
            self.q_proj = self.k_proj = self.v_proj = None

    def projections(self) -> list[Linear]:
        """The layers that read the attention block's input: qkv, or q, k and v."""
        if self.qkv_proj is not None:
            return [self.qkv_proj]
        return [self.q_proj, self.k_proj, self.v_proj]

    def __call__(self, x, rope, kv_pages, md: AttentionMetadata, row_scale=None):
        """x [T, hidden] (and its `row_scale`, see RMSNorm.prepare), rope: RoPE's (cos, sin)
        [T, head_dim] for the step's tokens (`rope_tables`) -> (out, kv_pages)."""
        T = x.shape[0]
        # q/k norms (qk_norm) and RoPE: applied by the attention call (`QKPrologue`), inside
        # the kernel at batch-1 decode on Hopper.
        norms = ({} if self.q_norm is None else dict(
            q_norm=self.q_norm.scale[...], k_norm=self.k_norm.scale[...], eps=self.q_norm.eps))
        prologue = QKPrologue(*rope, **norms)
        attend = functools.partial(ragged_paged_attention, sm_scale=self.head_dim ** -0.5,
                                   sliding_window=self.sliding_window)
        heads, kv_heads = P("batch", "heads", "head_dim"), P("batch", "kv_heads", "head_dim")
        pages = KV_PAGES_AXES
        sinks = None if self.sinks is None else self.sinks[...]
        if self.qkv_proj is not None:
            # The fused projection goes to attention whole (each device's columns hold its
            # q | k | v heads, `fuse_linears`): the one-token kernel reads it in place.
            qkv = (self.qkv_proj(x, row_scale),)
            qkv_specs = (P("batch", "heads"),)
        else:
            q, k, v = (self.q_proj(x, row_scale), self.k_proj(x, row_scale),
                       self.v_proj(x, row_scale))
            qkv = (q.reshape(T, self.num_heads, self.head_dim),
                   k.reshape(T, self.num_kv_heads, self.head_dim),
                   v.reshape(T, self.num_kv_heads, self.head_dim))
            qkv_specs = (heads, kv_heads, kv_heads)

        def local(kp, vp, md, sinks, prologue, *qkv):
            """The kernel per device, on its heads (and the KV heads they read)."""
            q, k, v = qkv if len(qkv) == 3 else (qkv[0], None, None)
            return attend(q, k, v, kp, vp, md, sinks=sinks, prologue=prologue)

        out, k_pages, v_pages = shard_map_logical(
            local, (pages, pages, P(), P("heads"), P(), *qkv_specs), (heads, pages, pages),
            *kv_pages, md, sinks, prologue, *qkv)
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
        self.gate_up_proj, self.gate_up_sizes = nnx.data(None), None  # see fuse_projections

    def fuse_projections(self):
        """gate/up as one projection (`fuse_linears`), in place; the runner calls it once."""
        if self.gate_up_proj is None and (fused := fuse_linears([self.gate_proj,
                                                                  self.up_proj])):
            self.gate_up_proj, self.gate_up_sizes = fused
            self.gate_proj = self.up_proj = None

    def projections(self) -> list[Linear]:
        """The layers that read the MLP's input: gate_up, or gate and up."""
        if self.gate_up_proj is not None:
            return [self.gate_up_proj]
        return [self.gate_proj, self.up_proj]

    def __call__(self, x, row_scale=None):
        """x [T, hidden] (and its `row_scale`, see RMSNorm.prepare) -> [T, hidden]."""
        if self.gate_up_proj is not None:
            gate, up = split_columns(self.gate_up_proj(x, row_scale), self.gate_up_sizes,
                                     "mlp")
        else:
            gate, up = self.gate_proj(x, row_scale), self.up_proj(x, row_scale)
        return self.down_proj(jax.nn.silu(gate) * up)
