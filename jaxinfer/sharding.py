"""Meshes, and the one table that maps logical axes to mesh axes.

Model code names the axes of its parameters (an `axes=` PartitionSpec of logical names on
each `nnx.Param`) and of the activations its kernels take, never mesh axes;
`LOGICAL_AXIS_RULES` maps each logical name to a mesh axis. A mesh spec such as
`tp=2,ep=4,dp=1` gives

  tp  tensor parallel: attention heads, KV heads, MLP columns and the vocabulary split;
      column-split projections feed row-split ones, so a block ends in one all-reduce.
  ep  expert parallel: each device holds num_experts / ep experts; every device sees all
      tokens, runs its experts' rows and one psum combines (see `jaxinfer.models.moe`).
  dp  data parallel: independent engine replicas, each on its own ep x tp sub-mesh
      (`ReplicatedEngine`), so "dp" is never an axis inside a model's mesh.

When tp exceeds the model's KV heads, each KV head is repeated tp / num_kv_heads times
(vLLM's choice): every device then holds the one KV head its query heads read.

Projections and kernels (attention, quantized and grouped matmuls, which are custom calls
XLA could not split anyway) run per device on their shards through `shard_map_logical`,
with explicit collectives (`reduce_over`); XLA partitions the rest (norms, sampling) from
the parameters' shardings.

The tp layout. Weights placed for tp are laid out for it: k/v rows repeated when tp exceeds
the KV heads, and rows that join several projections (an expert stack's gate | up, a
model's joined q/k/v and gate/up) interleaved per shard (`join_per_shard`), so each device
holds its slice of every part. Checkpoints hold the tp = 1 layout; `ParamPlacer` lays out
each checkpoint tensor, `jaxinfer.models.inference_form` joins the projections on the
devices. A placed model is therefore laid out for the tp of the mesh its parameters are on
(`layout_tp`), which is recorded nowhere else.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer.config import ModelConfig
from jaxinfer.errors import JaxinferError

MESH_AXES = ("ep", "tp")  # the axes of one replica's mesh (dp replicas are separate meshes)

# THE table: logical axis -> mesh axis (None: replicated on every device).
LOGICAL_AXIS_RULES: dict[str, str | None] = {
    "batch": None,      # a step's tokens and sequences: every device sees the whole batch
    "vocab": "tp",      # embedding rows, LM-head rows, logits
    "embed": None,      # the residual stream (hidden_size)
    "heads": "tp",      # query heads (q_proj rows, o_proj columns, sinks)
    "kv_heads": "tp",   # KV heads (k/v_proj rows, the KV cache pages' head axis)
    "head_dim": None,
    "mlp": "tp",        # MLP and expert intermediate columns
    "experts": "ep",    # expert stacks
}


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """dp x ep x tp devices (see the module docstring)."""

    dp: int = 1
    ep: int = 1
    tp: int = 1

    @classmethod
    def parse(cls, text: str | None) -> MeshSpec:
        """'tp=2,ep=4,dp=1' (any order, omitted axes 1; '' or None: one device)."""
        sizes = {}
        for part in filter(None, (p.strip() for p in (text or "").split(","))):
            m = re.fullmatch(r"(\w+)\s*=\s*(\d+)", part)
            if not m or m[1] not in ("dp", "ep", "tp") or int(m[2]) < 1 or m[1] in sizes:
                raise JaxinferError(f"--mesh {text!r}: expected comma-separated tp=N, ep=N, "
                                    f"dp=N with N >= 1, each at most once (bad part {part!r})")
            sizes[m[1]] = int(m[2])
        return cls(**sizes)

    @property
    def replica_size(self) -> int:
        return self.ep * self.tp

    @property
    def size(self) -> int:
        return self.dp * self.ep * self.tp

    def __str__(self):
        return f"tp={self.tp},ep={self.ep},dp={self.dp}"

    def check(self, config: ModelConfig, where: str = "the model"):
        """One-line errors for a mesh the model's shapes cannot be split over."""
        c, tp, ep = config, self.tp, self.ep
        problems = []
        if c.num_heads % tp:
            problems.append(f"num_heads={c.num_heads} is not divisible by tp={tp}")
        if c.num_kv_heads % tp and tp % c.num_kv_heads:
            problems.append(f"num_kv_heads={c.num_kv_heads} neither divides nor is divisible "
                            f"by tp={tp}")
        dense_layers = [i for i in range(c.num_layers) if not c.is_moe_layer(i)]
        if dense_layers and c.intermediate_size % tp:
            problems.append(f"intermediate_size={c.intermediate_size} is not divisible by "
                            f"tp={tp}")
        if ep > 1 and not c.is_moe:
            problems.append(f"ep={ep} needs a mixture-of-experts model")
        if c.is_moe:
            if c.num_experts % ep:
                problems.append(f"num_experts={c.num_experts} is not divisible by ep={ep}")
            if c.moe_intermediate_size % tp:
                problems.append(f"moe_intermediate_size={c.moe_intermediate_size} is not "
                                f"divisible by tp={tp}")
            if c.shared_expert_intermediate_size % tp:
                problems.append(f"shared_expert_intermediate_size="
                                f"{c.shared_expert_intermediate_size} is not divisible by "
                                f"tp={tp}")
        if problems:
            raise JaxinferError(f"--mesh {self}: {where}: {'; '.join(problems)}")

    def meshes(self, devices=None) -> list[Mesh]:
        """One ep x tp mesh per dp replica, over consecutive devices (tp fastest, so a tp
        group stays on one host)."""
        devices = list(jax.devices() if devices is None else devices)
        if self.size > len(devices):
            raise JaxinferError(f"--mesh {self}: needs {self.size} devices, "
                                f"{len(devices)} visible")
        grid = np.array(devices[:self.size], dtype=object).reshape(self.dp, self.ep, self.tp)
        return [Mesh(g, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES)) for g in grid]


# Messages up to this many bytes a device are summed by the peer-memory all-reduce
# (`reduce_over`): decode-sized, 64 tokens of a 4096-wide residual in bf16, where it was
# faster than NCCL at every size measured (bench/NOTES.md, Sharding). Larger ones (prefill)
# go to NCCL.
PEER_ALL_REDUCE_BYTES = 512 * 1024
# The most JAXINFER_ALL_REDUCE may ask for: the kernel unrolls a CTA's tiles (16 at 1 MiB).
PEER_ALL_REDUCE_MAX_BYTES = 1 << 20


def peer_all_reduce_capacity(mesh: Mesh) -> int:
    """The workspace capacity (bytes) of the peer-memory all-reduce for steps on `mesh`, 0
    where it is off. JAXINFER_ALL_REDUCE: `peer` (the default: messages up to
    PEER_ALL_REDUCE_BYTES), `xla` (XLA's all-reduce everywhere), or the largest message in
    bytes (rounded up to 16 KiB, the workspace's unit; 0: off). Off anyway on one device,
    on anything but Hopper GPUs (a Mosaic GPU kernel), and across processes (its workspace
    addresses are one process's)."""
    import os

    from jaxinfer.ops.platform import platform

    setting = os.environ.get("JAXINFER_ALL_REDUCE", "peer")
    if setting == "xla":
        size = 0
    elif setting == "peer":
        size = PEER_ALL_REDUCE_BYTES
    elif setting.isdigit() and int(setting) <= PEER_ALL_REDUCE_MAX_BYTES:
        from jaxinfer.mosaic.all_reduce import capacity_for

        size = int(setting) and capacity_for(int(setting))
    else:
        raise JaxinferError(f"JAXINFER_ALL_REDUCE={setting!r}: expected peer, xla or a "
                            f"message size of at most {PEER_ALL_REDUCE_MAX_BYTES} bytes")
    if (size == 0 or mesh.size == 1 or mesh.devices.flat[0].platform != "gpu"
            or platform() != "hopper" or jax.process_count() > 1):
        return 0
    return size


def sharded_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The config a tp-way model runs with: KV heads repeated up to tp when tp exceeds them."""
    if tp > config.num_kv_heads:
        return dataclasses.replace(config, num_kv_heads=tp)
    return config


def mesh_axis_size(mesh, axis: str | None) -> int:
    return 1 if axis is None or axis not in mesh.axis_names else mesh.shape[axis]


def logical_to_mesh(axes: P, shape=None, mesh=None) -> P:
    """A PartitionSpec of logical names -> one of mesh axes (LOGICAL_AXIS_RULES). A dim whose
    size (when `shape` is given) the mesh axis does not divide is replicated."""
    out = []
    for i, name in enumerate(axes):
        axis = LOGICAL_AXIS_RULES[name] if name is not None else None
        if mesh is not None and mesh_axis_size(mesh, axis) == 1:
            axis = None
        if axis is not None and shape is not None and shape[i] % mesh.shape[axis]:
            axis = None
        out.append(axis)
    return P(*out)


def current_mesh():
    """The mesh the step is being traced under (`jax.set_mesh`), or None on one device."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or mesh.size == 1 else mesh


def shard_map_logical(fn, in_axes, out_axes, *args):
    """fn(*args) run per device on its shards when a mesh is active (else just fn(*args)).

    in_axes / out_axes: pytrees (prefixes of args / of fn's result) of PartitionSpecs of
    logical names; an input dim its mesh axis does not divide is passed whole. fn sees
    local shapes and may use collectives over the mesh axes (e.g. `jax.lax.psum`).
    """
    mesh = current_mesh()
    if mesh is None:
        return fn(*args)
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    in_specs = jax.tree.map(
        lambda spec, arg: jax.tree.map(lambda a: logical_to_mesh(spec, a.shape, mesh), arg),
        tuple(in_axes), tuple(args), is_leaf=is_spec)
    out_specs = jax.tree.map(lambda spec: logical_to_mesh(spec, None, mesh), out_axes,
                             is_leaf=is_spec)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)(*args)


@dataclasses.dataclass(frozen=True)
class PeerAllReduce:
    """What a traced step needs to sum over its mesh with our one-shot kernel
    (`jaxinfer.mosaic.all_reduce`) instead of XLA's all-reduce: the workspace addresses
    (a traced argument of the step, [n, 2] uint32) and its capacity in bytes."""

    peers: jax.Array
    capacity: int


_PEER_ALL_REDUCE = contextvars.ContextVar("jaxinfer_peer_all_reduce", default=None)


@contextlib.contextmanager
def peer_all_reduce(config: PeerAllReduce | None):
    """While tracing a step: `reduce_over` sums messages that fit over the whole mesh with
    the peer-memory kernel (None: XLA's all-reduce everywhere). A context variable: set it
    on the thread that traces (programs compile on several)."""
    token = _PEER_ALL_REDUCE.set(config)
    try:
        yield
    finally:
        _PEER_ALL_REDUCE.reset(token)


def reduce_over(mesh_axes_logical: tuple[str, ...], x):
    """psum of x over the mesh axes the logical axes map to (inside shard_map_logical).

    The one place that picks the all-reduce: our one-shot peer-memory kernel where a step
    enabled it (`peer_all_reduce`) and the sum is over every device of the mesh along one
    axis, of a message it takes (up to its capacity: decode-sized); XLA's (NCCL) else."""
    mesh = current_mesh()
    if mesh is None:
        return x
    axes = tuple(a for name in mesh_axes_logical
                 if (a := LOGICAL_AXIS_RULES[name]) is not None and mesh_axis_size(mesh, a) > 1)
    if not axes:
        return x
    peer = _PEER_ALL_REDUCE.get()
    if peer is not None and len(axes) == 1 and mesh.shape[axes[0]] == mesh.size:
        from jaxinfer.mosaic import all_reduce

        if all_reduce.supports(x.shape, x.dtype, peer.capacity):
            return all_reduce.all_reduce_sum(x, peer.peers, axis_name=axes[0],
                                             capacity=peer.capacity)
    return jax.lax.psum(x, axes)


def shard_index(logical: str) -> jax.Array | int:
    """This device's index along the mesh axis of a logical axis (inside shard_map_logical)."""
    mesh = current_mesh()
    axis = LOGICAL_AXIS_RULES[logical]
    if mesh is None or mesh_axis_size(mesh, axis) == 1:
        return 0
    return jax.lax.axis_index(axis)


# -- placing parameters -------------------------------------------------------------------------

_KV_PROJ = re.compile(r"layers\.\d+\.attn\.[kv]_proj\.(weight|bias|weight_scale|weight_offset)")
_GATE_UP = re.compile(r"layers\.\d+\.mlp\.experts\.gate_up_proj\."
                      r"(weight|bias|weight_scale|weight_offset)")


class ParamPlacer:
    """Where each checkpoint tensor of a model goes on a mesh, and the layout changes tp needs.

    `param_axes` (from `jaxinfer.sharding.param_axes`) maps each checkpoint key to its
    logical axes. `place(key, array)` takes the tensor as stored (numpy on the host, or a jax
    array laid out for tp = 1) and returns it on the mesh laid out for its tp, each device
    holding only its shard:
      * k/v projections are repeated per KV head when tp > num_kv_heads;
      * an expert stack's fused gate_up rows [gate | up] are regrouped so that each tp shard
        holds [its gate columns | its up columns] (the activation splits the halves locally).
    """

    def __init__(self, config: ModelConfig, mesh: Mesh, param_axes: dict[str, P]):
        self.config, self.mesh, self.param_axes = config, mesh, param_axes
        self.tp = mesh_axis_size(mesh, "tp")
        self.kv_repeat = max(self.tp // config.num_kv_heads, 1)
        self.regroup = self.tp > 1
        self.model_config = sharded_config(config, self.tp)  # what the placed model runs

    def axes(self, key: str) -> P:
        return self.param_axes[key]

    def sharding(self, key: str, shape) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(key, shape))

    def spec(self, key: str, shape) -> P:
        """The mesh PartitionSpec of tensor `key` of `shape` (as placed)."""
        axes = self.axes(key)
        spec = logical_to_mesh(axes, shape, self.mesh)
        if key.endswith(("weight_scale", "weight_offset")) and shape[-2] > 1:
            # Per-group scales must split with their weight's input features (per-channel
            # scales, one row, are simply copied).
            axis = logical_to_mesh(axes, None, self.mesh)[-2]
            if axis is not None and spec[-2] is None:
                raise JaxinferError(f"{key}: {shape[-2]} groups of scales cannot be split "
                                    f"over {axis}={self.mesh.shape[axis]}")
        return spec

    def _relayout(self, key: str) -> tuple[str, int] | None:
        """("repeat", kv_repeat) for a k/v projection tensor when tp > num_kv_heads,
        ("regroup", tp) for an expert stack's gate_up tensor when tp > 1, else None."""
        if self.kv_repeat > 1 and _KV_PROJ.fullmatch(key):
            return "repeat", self.kv_repeat
        if self.regroup and _GATE_UP.fullmatch(key):
            return "regroup", self.tp
        return None

    def needs_transform(self, key: str) -> bool:
        return self._relayout(key) is not None

    def final_shape(self, key: str, shape) -> tuple[int, ...]:
        """The shape `place` gives a stored tensor of `shape` (repeating KV heads grows the
        out-features axis; regrouping keeps the shape)."""
        shape = list(shape)
        if (how := self._relayout(key)) and how[0] == "repeat":
            shape[_out_axis(key)] *= how[1]
        return tuple(shape)

    def place(self, key: str, array) -> jax.Array:
        how = self._relayout(key)
        if is_abstract(array):
            shape = self.final_shape(key, array.shape)
            return jax.ShapeDtypeStruct(shape, array.dtype, sharding=self.sharding(key, shape))
        if not isinstance(array, jax.Array):  # on the host: each device gets its slice
            array = np.asarray(array)
            if how:
                array = _relayout_array(array, *how, _out_axis(key),
                                        self.config.num_kv_heads, np)
            return jax.make_array_from_callback(array.shape,
                                                self.sharding(key, array.shape),
                                                lambda index: array[index])
        array = jax.device_put(array, self.sharding(key, array.shape))
        if not how:
            return array
        target = self.sharding(key, self.final_shape(key, array.shape))
        return _relayout_on_device(array, *how, _out_axis(key), self.config.num_kv_heads,
                                   target)


def _out_axis(key: str) -> int:
    """The out-features axis of a tensor: weight [..., N, K]; bias [..., N]; scale / offset
    [..., G, N]."""
    return -2 if key.endswith(".weight") else -1


def _relayout_array(a, how: str, factor: int, out_axis: int, kv_heads: int, xp):
    """`ParamPlacer`'s layout changes along the out-features axis (numpy or jax, by xp)."""
    a = xp.moveaxis(a, out_axis, 0)
    if how == "repeat":  # [kv_heads * D, ...] -> each head's D rows `factor` times
        heads = a.reshape(kv_heads, -1, *a.shape[1:])
        a = xp.repeat(heads, factor, axis=0).reshape(-1, *a.shape[1:])
    else:  # "regroup": [gate | up], each split in `factor` -> [gate_0 up_0 | gate_1 up_1 ...]
        a = join_per_shard(xp.split(a, 2, axis=0), 0, factor, xp)
    return xp.moveaxis(a, 0, out_axis)


def layout_tp(array: jax.Array) -> int:
    """The tp a placed parameter is laid out for: that of the mesh it is on (1 off a mesh)."""
    sharding = array.sharding
    return mesh_axis_size(sharding.mesh, "tp") if isinstance(sharding, NamedSharding) else 1


def join_per_shard(arrays, axis: int, shards: int, xp=np):
    """arrays joined along `axis` shard by shard: each is cut in `shards` equal pieces and
    the result is [a_0 b_0 ... | a_1 b_1 ... | ...], so that shard i of the result (split
    over `axis`) holds shard i of every array. numpy or jax, by xp."""
    pieces = [xp.moveaxis(a, axis, 0) for a in arrays]
    pieces = [p.reshape(shards, -1, *p.shape[1:]) for p in pieces]
    out = xp.concatenate(pieces, axis=1)
    return xp.moveaxis(out.reshape(-1, *out.shape[2:]), 0, axis)


def split_per_shard(array, sizes: tuple[int, ...], axis: int, shards: int, xp=jnp):
    """The arrays `join_per_shard` joined into `array`, of sizes `sizes` along `axis` (each
    a multiple of `shards`). numpy or jax, by xp."""
    a = xp.moveaxis(array, axis, 0)
    a = a.reshape(shards, -1, *a.shape[1:])
    ends = np.cumsum([s // shards for s in sizes])[:-1]
    return [xp.moveaxis(p.reshape(-1, *p.shape[2:]), 0, axis) for p in xp.split(a, ends, 1)]


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def join_per_shard_on_device(arrays, axis: int, shards: int, sharding):
    """`join_per_shard` on the devices, the result placed with `sharding`."""
    return jax.lax.with_sharding_constraint(join_per_shard(arrays, axis, shards, jnp), sharding)


def join_per_shard_recipe(arrays, axis: int, shards: int, sharding) -> ArrayRecipe:
    """`join_per_shard_on_device` of abstract arrays (`ArrayRecipe`s): the result's
    description and recipe."""
    shape = list(arrays[0].shape)
    shape[axis] = sum(a.shape[axis] for a in arrays)
    return ArrayRecipe(tuple(shape), jnp.result_type(*arrays), sharding, _join_per_shard_op,
                       (axis, shards), arrays)


def _join_per_shard_op(arrays, axis: int, shards: int):
    return join_per_shard(arrays, axis, shards, jnp)


class ArrayRecipe(jax.ShapeDtypeStruct):
    """An array described (shape, dtype, sharding) with how to compute it: `op(inputs,
    *static)`, a jax.numpy function of a tuple of arrays (each input a recipe itself), or
    (op None) checkpoint tensor `key` as placed. A model built from recipes of its
    checkpoint's tensors (`ConvertedCheckpoint`) holds recipes where it would hold arrays;
    `realize` computes them once the tensors are read, without building the model again."""

    def __init__(self, shape, dtype, sharding, op=None, static: tuple = (), inputs=(),
                 key: str | None = None):
        super().__init__(shape, dtype, sharding=sharding)
        self.op, self.static, self.inputs, self.key = op, static, tuple(inputs), key


def realize(recipes: list, tensors: dict) -> list:
    """The arrays of `recipes` (ArrayRecipes, or values kept as they are) computed from
    `tensors` (key -> placed array), which is consumed: each tensor is dropped once the last
    recipe that reads it is computed, so a model's peak stays near one copy of it. A recipe
    and the intermediate recipes only it reads run as one program (a join then a norm's
    scale: one pass over the weights, one compile for all layers alike)."""
    uses: dict[int, int] = {}

    def count(r):
        if isinstance(r, ArrayRecipe):
            uses[id(r)] = uses.get(id(r), 0) + 1
            if uses[id(r)] == 1:
                for x in r.inputs:
                    count(x)

    for r in recipes:
        count(r)
    done: dict[int, object] = {}

    def compute(r):
        if not isinstance(r, ArrayRecipe):
            return r
        if id(r) not in done:
            if r.op is None:
                done[id(r)] = tensors.pop(r.key)
            else:
                arrays = []  # what the fused program reads

                def expression(x):
                    if isinstance(x, ArrayRecipe) and x.op is not None and uses[id(x)] == 1:
                        return x.op, x.static, tuple(map(expression, x.inputs))
                    arrays.append(compute(x))
                    return len(arrays) - 1

                fused = _fused_program(expression(r), r.sharding)
                uses[id(r)] += 1  # expression(r) took r's own use
                done[id(r)] = fused(*arrays)
        uses[id(r)] -= 1
        return done[id(r)] if uses[id(r)] else done.pop(id(r))

    return [compute(r) for r in recipes]


@functools.lru_cache(maxsize=64)
def _fused_program(expression, sharding):
    """A jitted function of the arrays a `realize` expression reads: (op, static,
    (sub-expressions...)), or an int, the position of an argument."""
    def evaluate(e, args):
        if isinstance(e, int):
            return args[e]
        op, static, inputs = e
        return op(tuple(evaluate(x, args) for x in inputs), *static)

    return jax.jit(lambda *args: evaluate(expression, args), out_shardings=sharding)


def is_abstract(x) -> bool:
    """Whether x is an array's description (jax.ShapeDtypeStruct) rather than an array: a
    model built before its weights are read (`jaxinfer.loading.checkpoint.ConvertedCheckpoint`)
    holds those, and the functions that build one return descriptions for them."""
    return isinstance(x, jax.ShapeDtypeStruct)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _relayout_on_device(a, how, factor, out_axis, kv_heads, sharding):
    """`_relayout_array` on the devices (one compile per shape, shared by the layers)."""
    out = _relayout_array(a, how, factor, out_axis, kv_heads, jnp)
    return jax.lax.with_sharding_constraint(out, sharding)


def param_axes(axes_by_key: dict[str, P]) -> dict[str, P]:
    """Checkpoint key -> logical axes of every tensor a checkpoint may hold: those given (a
    model's float parameters, `jaxinfer.models.inference_form.checkpoint_layout`) and the
    quantized parts of each matrix (`weight_scale`, `weight_offset` [..., K // g, N])."""
    out = {}
    for key, axes in axes_by_key.items():
        out[key] = axes
        if key.endswith(".weight") and len(axes) >= 2:
            *stack, n, k = axes
            for part in ("weight_scale", "weight_offset"):
                out[key.removesuffix("weight") + part] = P(*stack, k, n)
    return out
