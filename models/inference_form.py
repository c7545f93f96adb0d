"""The model as it runs, built once from checkpoint-keyed parameters.

A checkpoint names every projection and norm on its own (`layers.3.attn.q_proj.weight`,
`layers.3.input_norm.scale`; `checkpoint_layout`): `jaxinfer convert` writes those keys,
the HF / GGUF sources yield them, `jaxinfer plan` counts them. The model runs in one form,
which its classes define (`jaxinfer.models.layers`, `jaxinfer.models.moe`):
  * q/k/v, and gate/up (of a dense MLP or a shared expert), are one `ProjectionGroup`
    each: their rows joined per shard into one Linear (`join_linears`, one GEMM) where
    they share a format, else (a GGUF's mixed formats) one Linear each in the group;
  * a norm in front of float projections is a `FoldedRMSNorm`, its scale multiplied into
    their weights (`Linear.fold_scale`); an MoE router without bias takes its norm's scale
    the same way (`FoldedRouter`), the norm itself staying for the experts;
  * a quantized projection's values are stored in the K order its decode kernel reads
    (`jaxinfer.ops.linear_registry.kernel_k_order`: int4 on Hopper), and taken back to K's
    own by `checkpoint_params`.

`inference_model` builds that form from parameters already placed on their devices (each
checkpoint tensor laid out for the mesh's tp by `jaxinfer.sharding.ParamPlacer`), once:
`jaxinfer.loading.checkpoint.load_model`, `shard_model` and
`jaxinfer.loading.presets.random_model` call it, and nothing changes a model afterwards.

Joins follow placement (rows interleaved per shard of the mesh the parts are on), so a
model is laid out for the tp of the mesh its parameters are on (`jaxinfer.sharding.
layout_tp`) and records it nowhere else. Moving a model to another tp takes it apart
(`checkpoint_params`, exact) and builds it again with the same norms folded
(`folded_modules`): folding rounds, so it is never undone or done twice.
"""

from __future__ import annotations

import gc
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.models.decoder import Decoder
from jaxinfer.models.layers import (
    MLP,
    FoldedRMSNorm,
    Linear,
    ProjectionGroup,
    abstract_module,
)
from jaxinfer.models.moe import FoldedRouter
from jaxinfer.ops.linear_registry import kernel_k_order
from jaxinfer.ops.quant import FP8_DTYPE, QuantizedWeight
from jaxinfer.sharding import P, is_abstract, split_per_shard

# A quantized projection `key` (its values) comes with `key_scale` and, if asymmetric,
# `key_offset` (the parts of a `QuantizedWeight`).
SCALE, OFFSET = "_scale", "_offset"


class TensorLayout(NamedTuple):
    """A checkpoint tensor's shape and logical axes (`jaxinfer.sharding`)."""
    shape: tuple[int, ...]
    axes: P


def checkpoint_layout(config: ModelConfig) -> dict[str, TensorLayout]:
    """Checkpoint key -> (shape, logical axes) of every parameter of a model of `config`,
    float as a checkpoint stores it (the quantized parts of a projection: see
    `jaxinfer.sharding.param_axes`); nothing allocated. Keys are in the order of the
    model's state (a seed of `random_model` draws its tensors in this order).

    Kept per config (its repr: a config holds a dict, so it does not hash): a load asks
    for the layout twice (the placer's axes, the stored shapes' check), and building the
    abstract model takes 0.2 s of the CPU's start-up each time."""
    key = repr(config)
    if key not in _LAYOUTS:
        if len(_LAYOUTS) >= 16:
            _LAYOUTS.clear()
        _LAYOUTS[key] = _checkpoint_layout(config)
    return dict(_LAYOUTS[key])


_LAYOUTS: dict[str, dict[str, TensorLayout]] = {}


def _checkpoint_layout(config: ModelConfig) -> dict[str, TensorLayout]:
    model = abstract_module(lambda: Decoder(config, dtype=jnp.float32, rngs=None))
    groups = _groups(model)
    out = {}
    for path, var in nnx.state(model, nnx.Param).flat_state():
        shape, axes = tuple(var.shape), var.get_metadata()["axes"]
        group = groups.get(path[:-3])  # path = (*group, "linears", 0, "weight" | "bias")
        if group is None:
            out[_key(path)] = TensorLayout(shape, axes)
            continue
        for name, size, axis in zip(group.names, group.sizes, group.out_axes, strict=True):
            out[_key((*path[:-4], name, path[-1]))] = TensorLayout((size, *shape[1:]),
                                                                 P(axis, *axes[1:]))
    return dict(sorted(out.items(), key=lambda item: _sort_key(item[0])))


def inference_model(config: ModelConfig, params: dict[str, jax.Array],
                    activations: str | None = None, *,
                    folded: frozenset[str] | None = None) -> Decoder:
    """The model of `config` in its inference form (see the module docstring), holding
    `params`: checkpoint key -> array, each placed on its devices (`ParamPlacer.place`), a
    quantized projection as its parts `key`, `key_scale`, `key_offset`. `params` is
    consumed (emptied), so that each part's memory goes once its group is joined. Given
    jax.ShapeDtypeStructs (each with its sharding), the model holds the descriptions of
    the arrays it would hold (`jaxinfer.loading.checkpoint.ConvertedCheckpoint`).

    activations: what fp8 weights take ("fp8": W8A8) or None. folded: the norms and
    routers (module paths, `folded_modules`) whose scales the weights in `params` hold
    already (a model taken apart by `checkpoint_params`); None (a checkpoint's
    parameters): fold every norm that `foldable` allows.
    """
    dtype = params["embed.embedding"].dtype
    abstract = is_abstract(params["embed.embedding"])
    model = abstract_module(lambda: Decoder(config, dtype=dtype, rngs=None))
    for path, group in _groups(model).items():
        in_axis = group.linears[0].axes[1]
        group.set_parts([_part(params, _key((*path[:-1], name)), P(axis, in_axis), dtype,
                               activations)
                         for name, axis in zip(group.names, group.out_axes, strict=True)])
    for key in [k for k in params if k.endswith(".weight" + SCALE)]:
        weight = key.removesuffix(SCALE)
        _module_at(model, weight.removesuffix(".weight")).set_quantized(
            _quantized_weight(params, weight, activations))
    flat = []
    for path, var in nnx.state(model, nnx.Param).flat_state():
        key = _key(path)
        if key in params:
            flat.append((path, var.replace(params.pop(key))))
        elif is_abstract(var.get_value()) and var.get_value().sharding is None:
            # abstract_module's placeholder (an abstract parameter given is placed)
            raise ValueError(f"inference_model: no tensor {key}")
    if params:
        raise ValueError(f"inference_model: tensors the model has no place for: "
                         f"{sorted(params)[:3]}")
    nnx.update(model, nnx.State.from_flat_path(flat))
    _fold_norms(model, folded)
    _store_for_kernels(model, dtype)
    if not abstract:
        gc.collect()  # joined parts sit in nnx's reference cycles until collected
    return model


def foldable(layers: list[Linear]) -> bool:
    """Whether a norm's scale may be folded into these projections: all float matrices (a
    quantized weight keeps its values as stored)."""
    return all(not lay.quantized and lay.weight.ndim == 2 for lay in layers)


def _store_for_kernels(model: Decoder, dtype):
    """Each quantized projection's values in the K order its decode kernel reads
    (`jaxinfer.ops.linear_registry.kernel_k_order`), placed as before."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, Linear) and node.quantized:
            w = node.quantized_weight()
            sharding = w.values.sharding
            k = w.shape[-1] if sharding is None else sharding.shard_shape(w.shape)[-1]
            node.store_in_k_order(kernel_k_order(w, k, dtype))


def _fold_norms(model: Decoder, folded: frozenset[str] | None):
    """Each layer's input norm into q/k/v, its post-attention norm into a dense MLP's
    gate/up or into an MoE block's router (without bias); see `inference_model`."""
    def folds(key: str, layers: list[Linear], scale) -> bool:
        """Whether the norm or router at `key` runs folded; deciding anew (folded None), it
        multiplies `scale` into the layers' weights when they allow it."""
        if folded is not None:
            return key in folded
        if not foldable(layers):
            return False
        for lay in layers:
            lay.fold_scale(scale)
        return True

    for i, layer in enumerate(model.layers):
        norm = layer.input_norm
        if folds(f"layers.{i}.input_norm", layer.attn.qkv_proj.linears, norm.scale.get_value()):
            layer.input_norm = FoldedRMSNorm.of(norm)
        norm, mlp = layer.post_attn_norm, layer.mlp
        if isinstance(mlp, MLP):
            if folds(f"layers.{i}.post_attn_norm", mlp.gate_up_proj.linears,
                     norm.scale.get_value()):
                layer.post_attn_norm = FoldedRMSNorm.of(norm)
        elif mlp.router.bias is None and folds(f"layers.{i}.mlp.router", [mlp.router],
                                               norm.scale.get_value()):
            mlp.router = FoldedRouter.of(mlp.router)


def checkpoint_params(model: Decoder) -> dict[str, jax.Array]:
    """The model's parameters under their checkpoint keys, as `inference_model` takes them:
    each group's joined rows taken apart again (exactly; per shard, as joined), quantized
    parts under `key_scale` / `key_offset`. The tensors keep the model's tp layout (k/v
    rows repeated where its tp exceeds the KV heads) and its folded scales
    (`folded_modules`)."""
    groups = _groups(model)
    # Values stored in a kernel's K order, back in K's own (a checkpoint's).
    k_ordered = {tuple(path): node.values_in_k_order() for path, node in nnx.iter_graph(model)
                 if isinstance(node, Linear) and node.k_order is not None}
    out = {}
    for path, var in nnx.state(model, nnx.Param).flat_state():
        array = var[...]
        if path[-1] == "weight" and tuple(path[:-1]) in k_ordered:
            array = k_ordered[tuple(path[:-1])]
        group = groups.get(path[:-3])  # path = (*group, "linears", i, leaf)
        if group is None:
            out[_key(path)] = array
            continue
        parent, leaf = path[:-4], path[-1]  # leaf: weight, bias, weight_scale, weight_offset
        if len(group.linears) > 1:  # one Linear per part
            out[_key((*parent, group.names[path[-2]], leaf))] = array
            continue
        axis = 1 if leaf in ("weight_scale", "weight_offset") else 0  # scales [G, N]
        shards = array.shape[axis] // array.sharding.shard_shape(array.shape)[axis]
        for name, part in zip(group.names, split_per_shard(array, group.sizes, axis, shards),
                              strict=True):
            out[_key((*parent, name, leaf))] = part
    return out


def folded_modules(model: Decoder) -> frozenset[str]:
    """The module paths of the model's folded norms and routers (`inference_model`'s
    `folded`)."""
    return frozenset(_key(path) for path, node in nnx.iter_graph(model)
                     if isinstance(node, FoldedRMSNorm | FoldedRouter))


def _part(params: dict, prefix: str, axes: P, dtype, activations) -> Linear:
    """The Linear of checkpoint projection `prefix` (e.g. "layers.0.attn.q_proj"), its
    tensors taken from params."""
    weight = params[prefix + ".weight"]
    bias = params.pop(prefix + ".bias", None)
    layer = abstract_module(lambda: Linear(weight.shape[1], weight.shape[0], axes=axes,
                                          bias=bias is not None, dtype=dtype,
                                          rngs=None))
    if prefix + ".weight" + SCALE in params:
        layer.set_quantized(_quantized_weight(params, prefix + ".weight", activations))
    else:
        layer.weight = nnx.Param(params.pop(prefix + ".weight"), axes=axes)
    if bias is not None:
        layer.bias = nnx.Param(bias, axes=P(axes[0]))
    return layer


def _quantized_weight(params: dict, key: str, activations) -> QuantizedWeight:
    """The QuantizedWeight of projection weight `key`, its parts taken from params."""
    values = params.pop(key)
    fp8 = jnp.dtype(values.dtype) == jnp.dtype(FP8_DTYPE)
    return QuantizedWeight(values, params.pop(key + SCALE), params.pop(key + OFFSET, None),
                           activations if fp8 else None)


def _groups(model) -> dict[tuple, ProjectionGroup]:
    return {path: node for path, node in nnx.iter_graph(model)
            if isinstance(node, ProjectionGroup)}


def _module_at(model: Decoder, prefix: str):
    """The submodule at a key prefix such as "layers.3.attn.o_proj"."""
    obj = model
    for part in prefix.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def _key(path) -> str:
    return ".".join(str(p) for p in path)


def _sort_key(key: str):
    """The model state's order: by path, list indices as numbers."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in key.split("."))
