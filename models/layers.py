"""Shared decoder layers: RMSNorm, GQA attention, SwiGLU MLP (RoPE: `jaxinfer.ops.rope`).

The classes define the model's one form, the one it runs in; linear weights are (out, in)
and any projection may be quantized (`Linear.set_quantized`, parts `weight`,
`weight_scale`, `weight_offset`):
  * the projections that read one input are a `ProjectionGroup` (q/k/v: `qkv_proj`,
    gate/up: `gate_up_proj`): one Linear over their rows joined per shard (one GEMM
    where there were three or two), or one Linear each where their formats differ;
  * the norm in front of float projections is a `FoldedRMSNorm`: its scale is multiplied
    into their weights, and they scale their output rows by 1 / rms(x) instead.
A checkpoint stores each projection and norm under its own key (`layers.3.attn.q_proj.weight`,
`layers.3.input_norm.scale`); `jaxinfer.models.inference_form` builds this form from those
keys once, when a model is loaded.
"""

from __future__ import annotations

import contextvars
import functools
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.ops.attention import KV_PAGES_AXES, AttentionMetadata
from jaxinfer.ops.attention_registry import ragged_paged_attention
from jaxinfer.ops.linear_registry import linear
from jaxinfer.ops.quant import (
    QuantizedWeight,
    chunk_order,
    codes_in_order,
    from_chunk_order,
)
from jaxinfer.ops.rope import QKPrologue, RowNorm, inverse_rms, scale_normed
from jaxinfer.sharding import (
    ArrayRecipe,
    P,
    current_mesh,
    is_abstract,
    join_per_shard_on_device,
    join_per_shard_recipe,
    reduce_over,
    shard_map_logical,
)

_init = nnx.initializers.normal(0.02)
_ABSTRACT = contextvars.ContextVar("jaxinfer_abstract_params", default=False)


def abstract_module[M](build: Callable[[], M]) -> M:
    """build() with every new parameter a jax.ShapeDtypeStruct: what nnx.eval_shape(build)
    gives, without tracing the initialisers (so build may pass rngs=None). Why: loading a
    model builds an abstract Decoder and a Linear per projection to fill with the stored
    arrays; traced, those took 0.8 s of the CPU's 3 s load of SmolLM2 (30 layers),
    untraced a fifth of that."""
    token = _ABSTRACT.set(True)
    try:
        return build()
    finally:
        _ABSTRACT.reset(token)


def new_param(shape: tuple[int, ...], dtype, init: Callable[[], jax.Array], *,
              axes: P) -> nnx.Param:
    """A parameter holding init() ([shape] dtype), or inside `abstract_module` its shape."""
    value = jax.ShapeDtypeStruct(shape, dtype) if _ABSTRACT.get() else init()
    return nnx.Param(value, axes=axes)

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
        shape = (*stack, out_features, in_features)
        self.weight = new_param(shape, dtype, lambda: _init(rngs.params(), shape, dtype),
                                axes=axes)
        self.bias = (new_param(shape[:-1], dtype, lambda: jnp.zeros(shape[:-1], dtype),
                               axes=P(*axes[:-1]))
                     if bias else None)
        self.weight_scale = nnx.data(None)
        self.weight_offset = nnx.data(None)
        self.activations = None
        self.k_order = None  # the values' K order (`QuantizedWeight.k_order`)

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
        self.k_order = w.k_order

    def store_in_k_order(self, k_order: str | None):
        """Stores this quantized layer's values in `k_order` (`QuantizedWeight.k_order`:
        None, K's own; "chunks", the Mosaic kernel's), placed as they were; once, at load
        (`jaxinfer.models.inference_form`)."""
        if k_order == self.k_order:
            return
        values = self.weight.get_value()
        order = chunk_order if k_order is None else from_chunk_order
        if is_abstract(values):
            values = ArrayRecipe(values.shape, values.dtype, values.sharding, _in_order,
                                 (order,), (values,))
        else:
            values = _store_in_order(values, order, values.sharding)
        self.weight = nnx.Param(values, axes=self.axes)
        self.k_order = k_order

    def values_in_k_order(self) -> jax.Array:
        """This quantized layer's values in K's own order (a checkpoint's), placed like the
        stored ones (which stay)."""
        values = self.weight.get_value()
        if self.k_order is None:
            return values
        return _in_order_placed(values, chunk_order, values.sharding)

    def fold_scale(self, scale):
        """Multiplies scale [in] into the input columns of this float weight [out, in]: the
        layer then computes on x what it computed on x * scale (`FoldedRMSNorm`). In
        float32, rounded back to the weight's dtype and placed like it; in bf16 that rounds
        W * scale where HF rounds the scaled activations: as accurate, not bit-identical."""
        w = self.weight.get_value()
        scaled = _scale_columns_recipe if is_abstract(w) else _scale_columns
        self.weight = nnx.Param(scaled(w, scale, w.sharding), axes=self.axes)

    def quantized_weight(self) -> QuantizedWeight:
        offset = None if self.weight_offset is None else self.weight_offset.get_value()
        return QuantizedWeight(self.weight.get_value(), self.weight_scale.get_value(), offset,
                               self.activations, self.k_order)

    def weight_and_axes(self):
        """(the float weight or QuantizedWeight, a matching pytree of logical axes)."""
        if not self.quantized:
            return self.weight[...], self.axes
        w = self.quantized_weight()
        *stack, n, k = self.axes
        parts = P(*stack, k, n)
        return w, QuantizedWeight(self.axes, parts, None if w.offsets is None else parts,
                                  w.activations, w.k_order)

    def __call__(self, x, row_scale=None, *, rounded: bool = False,
                 prologue: str | None = None):
        """x [..., in] -> [..., out]; `row_scale` [..., 1] f32, `rounded`: see `linear`;
        `prologue` "swiglu": x [..., 2 in], on a mesh each device's slice the gate | up
        halves of its `in` features (a joined gate_up's output: `join_linears`)."""
        bias = None if self.bias is None else self.bias[...]
        w, w_axes = self.weight_and_axes()
        if current_mesh() is None:
            return linear(x, w, bias, row_scale, rounded=rounded, prologue=prologue)
        # On a mesh each device multiplies by its shard (the same dot, or kernel, as on one
        # device); a split `in` axis leaves partial sums, which one psum joins: the one
        # all-reduce of a column-split -> row-split block.
        out_axis, in_axis = self.axes
        lead = (None,) * (x.ndim - 1)
        in_features = self.weight.shape[-1]

        args, axes = [x, w], [P(*lead, in_axis), w_axes]
        for extra, extra_axes in ((bias, P(out_axis)), (row_scale, P(*lead, None))):
            if extra is not None:
                args.append(extra)
                axes.append(extra_axes)

        def local(x, w, *extras):
            extras = iter(extras)
            b = None if bias is None else next(extras)
            scale = None if row_scale is None else next(extras)
            if w.shape[-1] == in_features:
                return linear(x, w, b, scale, rounded=rounded, prologue=prologue)
            y = reduce_over((in_axis,), linear(x, w, prologue=prologue))
            if b is None and scale is None:
                return y
            y = y.astype(jnp.float32) * (1.0 if scale is None else scale)
            return (y if b is None else y + b.astype(jnp.float32)).astype(x.dtype)

        return shard_map_logical(local, tuple(axes), P(*lead, out_axis), *args)


def join_linears(parts: list[Linear]) -> Linear | None:
    """One Linear computing every part's output side by side: parts[0], changed in place to
    hold them all; None when the parts differ in format or layout (they then stay apart).

    The parts (same input, same format: float or one quantized format, bias or not, placed
    alike) are joined along their out-features axis *per shard*: on a mesh that splits
    out-features in n shards, the joined rows are [a_0 b_0 c_0 | a_1 b_1 c_1 | ...], so each
    device's slice of the joined output holds its slices of every part (`split_columns`
    takes them apart without communication); on one device that is [a | b | c].

    Why: fewer, larger GEMMs. Llama-8B batch-1 decode on an H200: gate_up as one GEMM took
    58.8 us where gate and up took 75 (bench/NOTES.md, Serving engine decode loop: Fused q/k/v
    and gate/up projections).
    """
    def tensors(layer: Linear):
        w = layer.quantized_weight() if layer.quantized else None
        return ([layer.weight.get_value()] if w is None else
                [w.values, w.scales] + ([] if w.offsets is None else [w.offsets]))

    def signature(layer: Linear):
        """All but the out-features: parts with equal signatures can be joined."""
        sig = [layer.quantized, layer.activations, layer.k_order, layer.bias is not None]
        for i, t in enumerate(tensors(layer)):  # values [N, K]; scales, offsets [G, N]
            spec = (t.sharding.spec if isinstance(t.sharding, jax.sharding.NamedSharding)
                    else None)
            sig.append((t.dtype, t.shape[1:] if i == 0 else t.shape[:-1], spec))
        return tuple(sig)

    first = parts[0]
    if len({signature(lay) for lay in parts}) != 1 or len(first.axes) != 2:
        return None
    values = [tensors(lay)[0] for lay in parts]
    shards = {v.shape[0] // v.sharding.shard_shape(v.shape)[0] for v in values}
    if len(shards) != 1:
        return None
    shards = shards.pop()
    # values join along axis 0, scales and offsets [G, N] along axis 1.
    join = join_per_shard_recipe if is_abstract(values[0]) else join_per_shard_on_device
    joined = [join(tuple(tensors(lay)[i] for lay in parts), min(i, 1), shards, t.sharding)
              for i, t in enumerate(tensors(first))]
    axes = first.axes
    first.weight = nnx.Param(joined[0], axes=axes)
    if first.quantized:
        parts_axes = P(axes[1], axes[0])
        first.weight_scale = nnx.Param(joined[1], axes=parts_axes)
        if len(joined) > 2:
            first.weight_offset = nnx.Param(joined[2], axes=parts_axes)
    if first.bias is not None:
        bias = first.bias.get_value()
        first.bias = nnx.Param(join(tuple(lay.bias.get_value() for lay in parts), 0, shards,
                                    bias.sharding), axes=P(axes[0]))
    return first


def split_columns(y, sizes: tuple[int, ...], axis: str):
    """y [..., sum(sizes)] from a joined Linear (`join_linears`) -> one array per part, each
    [..., size], on a mesh split over the mesh axis of logical `axis` like y."""
    total = sum(sizes)

    def local(y):
        n = y.shape[-1]  # total / shards: this device's slice of every part
        return tuple(jnp.split(y, np.cumsum([s * n // total for s in sizes])[:-1], axis=-1))

    spec = P(*(None,) * (y.ndim - 1), axis)
    return shard_map_logical(local, (spec,), (spec,) * len(sizes), y)


class ProjectionGroup(nnx.Module):
    """The projections that read one input (q/k/v, gate/up), static: `names` (each one's
    checkpoint name, e.g. "q_proj"), `sizes` (their out-features) and `out_axes` (the
    logical axis of each one's out-features).

    `linears` holds one Linear over all of them, their rows joined per shard
    (`join_linears`), or, where their formats differ (a GGUF may keep q in Q4_0 and v in
    Q8_0), one Linear per part in `names` order. Its caller has one path either way:
    `__call__` gives each part's output, `joined` all of them side by side as the joined
    Linear lays them out. A group built here (random weights) is joined.
    """

    def __init__(self, in_features: int, parts: dict[str, tuple[int, str]], *, bias: bool,
                 dtype, rngs: nnx.Rngs, in_axis: str = "embed"):
        """parts: name -> (out-features, logical out axis), in the order of the outputs."""
        self.names = tuple(parts)
        self.sizes = tuple(size for size, _ in parts.values())
        self.out_axes = tuple(axis for _, axis in parts.values())
        self.linears = nnx.List([Linear(in_features, sum(self.sizes),
                                        axes=P(self.out_axes[0], in_axis), bias=bias,
                                        dtype=dtype, rngs=rngs)])

    def set_parts(self, parts: list[Linear]):
        """Holds `parts` (one Linear per name, in order, weights placed): joined into one by
        `join_linears` where it can, else as they are."""
        joined = join_linears(parts)
        self.linears = nnx.List([joined] if joined is not None else parts)

    def __call__(self, x, row_scale=None) -> tuple[jax.Array, ...]:
        """x [..., in] (and its `row_scale`, see `linear`) -> each part's output [..., size]."""
        if len(self.linears) == 1:
            return split_columns(self.linears[0](x, row_scale), self.sizes, self.out_axes[0])
        return tuple(lay(x, row_scale) for lay in self.linears)

    def joined(self, x, row_scale=None, *, rounded: bool = False) -> jax.Array:
        """x [..., in] -> [..., sum(sizes)]: the parts' outputs side by side per shard, as
        one joined Linear gives them (separate parts are concatenated on each device);
        `rounded`: see `linear`."""
        if len(self.linears) == 1:
            return self.linears[0](x, row_scale, rounded=rounded)
        specs = tuple(P(*(None,) * (x.ndim - 1), axis) for axis in self.out_axes)
        return shard_map_logical(lambda *ys: jnp.concatenate(ys, axis=-1), specs, specs[0],
                                 *(lay(x, row_scale, rounded=rounded) for lay in self.linears))


class RMSNorm(nnx.Module):
    """HF's order of operations: normalise in f32, cast back, then scale [dim] (the math of
    `jaxinfer.ops.rope`, which the q/k norms share)."""

    def __init__(self, dim, *, eps, dtype, axes: P | None = None):
        self.scale = new_param((dim,), dtype, lambda: jnp.ones((dim,), dtype),
                               axes=axes or P("embed"))
        self.eps = eps

    def inv_rms(self, x):
        """x [..., dim] -> 1 / rms(x) [..., 1] float32."""
        return inverse_rms(x.astype(jnp.float32), self.eps)

    def __call__(self, x):
        return self.scaled(x, self.inv_rms(x))

    def scaled(self, x, inv_rms):
        """The norm of x given its `inv_rms(x)` (computed elsewhere, e.g. with other rows)."""
        return scale_normed(x.astype(jnp.float32), inv_rms, self.scale[...], x.dtype)

    def projection_input(self, x):
        """(the input of the projections this norm feeds, the `RowNorm` whose 1 / rms they
        scale their rows by): (norm(x), None)."""
        return self(x), None


def projection_row_scale(row_norm: RowNorm | None):
    """The row scale of the projections a `FoldedRMSNorm` feeds (`linear`'s row_scale): its
    1 / rms [T, 1] float32, or None after a plain norm."""
    return None if row_norm is None else row_norm.inverse()


class FoldedRMSNorm(RMSNorm):
    """An RMSNorm whose scale is multiplied into the input columns of the float projections
    it feeds (`Linear.fold_scale`): they read x itself and scale their output rows by
    1 / rms(x), as linear(x, W * scale, row_scale=1 / rms(x)) = linear(norm(x), W). The
    scale stays a parameter (a checkpoint key, counted by `jaxinfer plan`); the
    projections do not read it.

    Why: at batch 1 the normalised activations cost a kernel of their own before each
    projection (a reduce, then a multiply); with the scale in the weight, XLA fuses the
    multiply by 1 / rms into the kernels that already read the projection's output
    (split-K sums, RoPE, SiLU) (bench/NOTES.md, Serving engine decode loop: Norm scales folded
    into the projections).
    """

    @classmethod
    def of(cls, norm: RMSNorm) -> FoldedRMSNorm:
        """`norm` (its scale and eps) as a folded norm."""
        scale = norm.scale
        folded = abstract_module(lambda: cls(scale.shape[0], eps=norm.eps, dtype=scale.dtype,
                                             axes=scale.get_metadata()["axes"]))
        folded.scale = nnx.Param(scale.get_value(), axes=scale.get_metadata()["axes"])
        return folded

    def projection_input(self, x):
        """(x, its `RowNorm`: the projections' row scale is its 1 / rms)."""
        return x, RowNorm.of(x.astype(jnp.float32), self.eps)


def _in_order(arrays, order):
    """(values [N, K],) -> `codes_in_order`(values, order) (an `ArrayRecipe`'s op)."""
    (values,) = arrays
    return codes_in_order(values, order)


def _placed_in_order(values, order, sharding):
    """`_in_order` on the devices, placed like values (`sharding`)."""
    return jax.lax.with_sharding_constraint(_in_order((values,), order), sharding)


_in_order_placed = jax.jit(_placed_in_order, static_argnums=(1, 2))
# (donated: the stored values take the old ones' buffer, as `_scale_columns` explains)
_store_in_order = jax.jit(_placed_in_order, static_argnums=(1, 2), donate_argnums=0)


def _scaled_columns(arrays):
    """(w [N, K], scale [K]) -> w * scale in float32, back in w's dtype."""
    w, scale = arrays
    return (w.astype(jnp.float32) * scale.astype(jnp.float32)[None, :]).astype(w.dtype)


@functools.partial(jax.jit, static_argnums=2, donate_argnums=0)
def _scale_columns(w, scale, sharding):
    """`_scaled_columns` on the devices, placed like w (`sharding`). w is donated: the
    scaled weight takes its buffer, so the old weight's memory never outlives the call,
    whatever still refers to it (nnx's reference cycles kept the replaced weights of a
    whole load until its `gc.collect()` when that ran after other work: peak 23.71 GiB
    against 15.43 for the 8B model, and the holes it left failed the KV cache's
    allocation)."""
    return jax.lax.with_sharding_constraint(_scaled_columns((w, scale)), sharding)


def _scale_columns_recipe(w, scale, sharding) -> ArrayRecipe:
    """`_scale_columns` of an abstract weight (`ArrayRecipe`)."""
    return ArrayRecipe(w.shape, w.dtype, sharding, _scaled_columns, (), (w, scale))


class Attention(nnx.Module):
    """GQA attention over the paged KV cache; layer `layer` of the config (its window)."""

    def __init__(self, config: ModelConfig, *, layer: int = 0, dtype, rngs: nnx.Rngs):
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.qkv_proj = ProjectionGroup(
            c.hidden_size, {"q_proj": (q_size, "heads"), "k_proj": (kv_size, "kv_heads"),
                            "v_proj": (kv_size, "kv_heads")},
            bias=c.qkv_bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(q_size, c.hidden_size, axes=P("embed", "heads"), bias=c.o_bias,
                             dtype=dtype, rngs=rngs)
        if c.qk_norm:
            norm = dict(eps=c.rms_norm_eps, dtype=dtype, axes=P("head_dim"))
            self.q_norm, self.k_norm = RMSNorm(c.head_dim, **norm), RMSNorm(c.head_dim, **norm)
        else:
            self.q_norm = self.k_norm = None
        # gpt-oss: a learned logit per query head joins each softmax's denominator.
        heads = (c.num_heads,)
        self.sinks = (new_param(heads, dtype, lambda: jnp.zeros(heads, dtype), axes=P("heads"))
                      if c.attention_sinks else None)
        self.sliding_window = c.layer_window(layer)
        self.config = c

    def __call__(self, x, rope, kv_pages, md: AttentionMetadata,
                 row_norm: RowNorm | None = None):
        """x [T, hidden] (and its `row_norm`, see `RMSNorm.projection_input`), rope: RoPE's
        (cos, sin) [T, head_dim] for the step's tokens (`rope_tables`) -> (out, kv_pages)."""
        T = x.shape[0]
        # The input norm's row scale, q/k norms (qk_norm) and RoPE: applied by the attention
        # call (`QKPrologue`), inside a kernel on Hopper (the one that writes the pages).
        norms = ({} if self.q_norm is None else dict(
            q_norm=self.q_norm.scale[...], k_norm=self.k_norm.scale[...], eps=self.q_norm.eps))
        # The input norm's row scale: applied by attention's prologue, except where a bias
        # follows it (`linear` adds the bias after the scale), by the projection.
        proj_scale, late_norm = ((projection_row_scale(row_norm), None) if self.config.qkv_bias
                                 else (None, row_norm))
        prologue = QKPrologue(*rope, **norms, row_norm=late_norm)
        attend = functools.partial(ragged_paged_attention, sm_scale=self.head_dim ** -0.5,
                                   sliding_window=self.sliding_window)
        heads = P("batch", "heads", "head_dim")
        pages = KV_PAGES_AXES
        sinks = None if self.sinks is None else self.sinks[...]
        # q | k | v go to attention as one array (each device's columns hold its q, k and v
        # heads, `join_linears`): kernels read them from it in place, so the product comes
        # rounded by its GEMM (`rounded`: a float32 product took a cast kernel of its own).
        qkv = self.qkv_proj.joined(x, proj_scale, rounded=True)

        def local(kp, vp, md, sinks, prologue, qkv):
            """The kernel per device, on its heads (and the KV heads they read)."""
            return attend(qkv, None, None, kp, vp, md, sinks=sinks, prologue=prologue)

        out, k_pages, v_pages = shard_map_logical(
            local, (pages, pages, P(), P("heads"), P(), P("batch", "heads")),
            (heads, pages, pages), *kv_pages, md, sinks, prologue, qkv)
        return self.o_proj(out.reshape(T, -1)), (k_pages, v_pages)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), of `intermediate_size` (default: the config's)."""

    def __init__(self, config: ModelConfig, *, intermediate_size: int | None = None, dtype,
                 rngs: nnx.Rngs):
        c = config
        i = intermediate_size or c.intermediate_size
        self.gate_up_proj = ProjectionGroup(
            c.hidden_size, {"gate_proj": (i, "mlp"), "up_proj": (i, "mlp")},
            bias=c.mlp_bias, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(i, c.hidden_size, axes=P("embed", "mlp"), bias=c.mlp_bias,
                                dtype=dtype, rngs=rngs)

    def __call__(self, x, row_norm: RowNorm | None = None):
        """x [T, hidden] (and its `row_norm`, see `RMSNorm.projection_input`) -> [T, hidden]."""
        # gate | up side by side, as the joined projection lays them out: down applies the
        # SwiGLU (a W8A8 down in the pass that quantizes its input; `linear`'s prologue)
        gate_up = self.gate_up_proj.joined(x, projection_row_scale(row_norm))
        return self.down_proj(gate_up, prologue="swiglu")
