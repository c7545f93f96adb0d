"""Memory planner: what a model on a mesh needs on each device, computed without allocating.

Per device of one ep x tp replica (every dp replica is a copy, so dp changes nothing here):

  weights   the bytes of this device's shards of every parameter: the parameters' shapes and
            dtypes as they would be loaded (a converted checkpoint's stored dtypes, read from
            its Orbax metadata; else every float at `dtype`, and projections at `quantization`
            if given), after the tp relayout (`ParamPlacer`: KV heads repeated up to tp), split
            by the sharding rules of `jaxinfer.sharding` (all shards of a split are equal, so
            every device of a replica holds the same bytes). 4-bit values count half a byte.
  reserve   room kept for a step's temporaries (see `default_reserve`).
  KV cache  the rest of hbm * memory_fraction, in pages: per layer a key and a value page
            [page_size, num_kv_heads, head_dim] at the float dtype of the weights, split over
            KV heads by tp like the k/v projections (`KV_PAGES_AXES`). The runner allocates
            one more page than the engine uses (a scratch page), so the planner leaves room
            for it.

`plan_kv_cache` applies the same arithmetic to a loaded model on real devices (what `LLM`
does without kv_cache_bytes): usable is JAX's device memory pool (`device_memory_bytes`, which
`set_memory_utilization` sizes before JAX starts), the weights are the loaded arrays' bytes.

A page is one page on every device of the replica (each holds its KV heads' share of it), so
pages, tokens and sequences are per replica; `kv_cache_bytes` is the `LLM(kv_cache_bytes=...)`
(per replica, counting the KV heads of all tp devices) that gets exactly `num_pages`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh
from safetensors import safe_open

from jaxinfer.config import ModelConfig
from jaxinfer.engine.defaults import ACCELERATOR_DEFAULTS
from jaxinfer.errors import JaxinferError
from jaxinfer.loading import checkpoint
from jaxinfer.loading.checkpoint import DTYPES, OFFSET, SCALE
from jaxinfer.loading.gguf_source import GGUFSource, gguf_key
from jaxinfer.loading.hf_source import expert_stack_key, hf_key
from jaxinfer.loading.presets import PRESETS
from jaxinfer.models.inference_form import checkpoint_layout
from jaxinfer.models.layers import is_quantizable
from jaxinfer.ops.attention import KV_PAGES_AXES
from jaxinfer.ops.quant import VALUE_DTYPES, parse_format
from jaxinfer.sharding import (
    MESH_AXES,
    MeshSpec,
    ParamPlacer,
    logical_to_mesh,
    mesh_axis_size,
    param_axes,
    sharded_config,
)

GiB = 1 << 30
WORKSPACE_BYTES = 512 << 20  # XLA / cuBLAS workspaces, compiled programs, a step's inputs
DEFAULT_CONTEXT_CAP = 8192  # the default --context: the model's context, capped here
# vLLM's gpu_memory_utilization: the share of each accelerator's memory the engine takes.
DEFAULT_MEMORY_UTILIZATION = 0.9
JAX_DEFAULT_MEM_FRACTION = 0.75  # JAX's pool when XLA_PYTHON_CLIENT_MEM_FRACTION is unset
# The planned KV cache is rounded down to whole units of this much per device, so small
# differences between runs (none are expected: the weights' bytes are their shapes') cannot
# change its size, which the compiled programs are keyed on.
KV_ROUNDING_BYTES = 64 << 20
CPU_KV_CACHE_CAP = GiB  # the CPU's pool: what the sequences need, at most this


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes are per device; pages, tokens and sequences per replica (see the module doc)."""

    model: str
    mesh: str
    devices: int  # dp * ep * tp
    hbm_bytes: int
    memory_fraction: float
    usable_bytes: int  # hbm_bytes * memory_fraction
    weight_bytes: int
    weight_bytes_by_dtype: dict[str, int]
    holes_bytes: int  # free memory between the loaded weights (`load_holes_per_device`)
    reserve_bytes: int
    kv_dtype: str
    kv_bytes: int  # what the KV cache gets: usable - weights - holes - reserve
    page_size: int
    page_bytes: int  # one page (k and v, every layer) on one device
    num_pages: int  # pages the engine can use (the runner's scratch page is extra)
    kv_tokens: int  # num_pages * page_size
    max_model_len: int  # the longest sequence: num_pages * page_size, capped by the model
    context: int
    pages_per_seq: int
    max_seqs: int  # sequences of `context` tokens held at once, per replica
    dp: int
    kv_cache_bytes: int  # the LLM(kv_cache_bytes=...) that gets num_pages pages

    def format(self) -> str:
        """A short table for the terminal."""
        size = lambda b: f"{_size(b):>12}"  # noqa: E731
        dtypes = ", ".join(f"{d} {_size(b)}" for d, b in self.weight_bytes_by_dtype.items())
        seqs = f"{self.max_seqs} per replica"
        if self.dp > 1:
            seqs += f", {self.max_seqs * self.dp} in all (dp={self.dp})"
        lines = [
            f"model        {self.model}",
            f"mesh         {self.mesh} ({self.devices} device{'s' * (self.devices > 1)})",
            f"per device   {self.hbm_bytes / GiB:.2f} GiB x {self.memory_fraction:g} = "
            f"{self.usable_bytes / GiB:.2f} GiB usable",
            f"  weights  {size(self.weight_bytes)}  ({dtypes})",
            f"  holes    {size(self.holes_bytes)}  (what loading leaves between the weights)",
            f"  reserve  {size(self.reserve_bytes)}  (workspace, activations, logits, autotuning)",
            f"  KV cache {size(self.kv_bytes)}  ({self.kv_dtype}, {_size(self.page_bytes)} per "
            f"page of {self.page_size} tokens)",
            f"KV pages     {self.num_pages} ({self.kv_tokens} tokens; longest sequence "
            f"{self.max_model_len})",
            f"context      {self.context} tokens = {self.pages_per_seq} pages per sequence",
            f"max seqs     {seqs}",
            f"LLM(kv_cache_bytes={self.kv_cache_bytes})",
        ]
        return "\n".join(lines)


def plan_memory(config: ModelConfig, mesh_spec: MeshSpec | str | None, hbm_bytes: int, *,
                dtype: str = "bfloat16", quantization: str | None = None,
                tensors: dict[str, jax.ShapeDtypeStruct] | None = None,
                page_size: int = 16, context: int | None = None,
                memory_fraction: float = 0.9, reserve_bytes: int | None = None,
                max_num_seqs: int = ACCELERATOR_DEFAULTS.max_num_seqs,
                max_num_batched_tokens: int = ACCELERATOR_DEFAULTS.max_num_batched_tokens,
                name: str = "the model") -> MemoryPlan:
    """The plan of `config` on `mesh_spec` with `hbm_bytes` of memory per device.

    tensors: checkpoint key -> shape and dtype as loaded (before the tp relayout), e.g. from
    `model_tensors`; None: every parameter of the model at `dtype`, the decoder-block
    projections quantized to `quantization` (a `jaxinfer.ops.quant.parse_format` spelling) if
    given. context: default the model's max_position_embeddings capped at 8192.
    reserve_bytes: default `default_reserve(...)` for max_num_seqs and max_num_batched_tokens.
    Raises JaxinferError if the mesh does not split the model or nothing is left for the KV
    cache.
    """
    spec = mesh_spec if isinstance(mesh_spec, MeshSpec) else MeshSpec.parse(mesh_spec)
    if page_size < 1 or not 0 < memory_fraction <= 1:
        raise JaxinferError(f"page_size={page_size} must be >= 1 and memory_fraction="
                            f"{memory_fraction} in (0, 1]")
    spec.check(config, name)
    if context is None:
        context = min(config.max_position_embeddings, DEFAULT_CONTEXT_CAP)
    if not 1 <= context <= config.max_position_embeddings:
        raise JaxinferError(f"--context {context}: expected 1 to the model's "
                            f"max_position_embeddings ({config.max_position_embeddings})")
    layout = checkpoint_layout(config)
    if tensors is None:
        tensors = float_tensors(config, dtype, quantization, layout=layout)
    mesh = AbstractMesh((spec.ep, spec.tp), MESH_AXES)
    placer = ParamPlacer(config, mesh, param_axes({k: t.axes for k, t in layout.items()}))
    weights = weight_bytes_per_device(placer, tensors)
    weight_total = sum(weights.values())
    largest = largest_tensor_bytes_per_device(placer, tensors)
    holes = load_holes_per_device(placer, tensors)
    run_config = sharded_config(config, spec.tp)
    kv_dtype = jnp.dtype(tensors["embed.embedding"].dtype)
    page_bytes = kv_page_bytes(run_config, page_size, kv_dtype, mesh)
    if reserve_bytes is None:
        reserve_bytes = default_reserve(run_config, spec.tp, max_num_seqs,
                                        max_num_batched_tokens, largest)
    usable = int(hbm_bytes * memory_fraction)
    pages_per_seq = -(-context // page_size)
    kv_bytes, num_pages = kv_pages(
        f"{name} on {spec}", usable, f"{_size(hbm_bytes)} x {memory_fraction:g}",
        weight_total, reserve_bytes, page_bytes, 1,
        free_block=max(usable - weight_total - holes, 0))
    return MemoryPlan(
        model=name, mesh=str(spec), devices=spec.size, hbm_bytes=int(hbm_bytes),
        memory_fraction=memory_fraction, usable_bytes=usable,
        weight_bytes=weight_total, weight_bytes_by_dtype=weights, holes_bytes=holes,
        reserve_bytes=reserve_bytes, kv_dtype=kv_dtype.name, kv_bytes=kv_bytes,
        page_size=page_size, page_bytes=page_bytes, num_pages=num_pages,
        kv_tokens=num_pages * page_size,
        max_model_len=min(config.max_position_embeddings, num_pages * page_size),
        context=context, pages_per_seq=pages_per_seq, max_seqs=num_pages // pages_per_seq,
        dp=spec.dp, kv_cache_bytes=num_pages * page_bytes * spec.tp)


def suggest_mesh(config: ModelConfig, gpus: int, hbm_bytes: int, *, name: str = "the model",
                 **plan_kwargs) -> tuple[MeshSpec, MemoryPlan]:
    """The layout `jaxinfer plan --gpus N` suggests, with its plan: the fewest devices per
    replica (tp = 1, 2, 4, ... dividing `gpus`) on which the weights, the reserve and one
    sequence of the plan's context fit; the other devices as dp replicas.

    Why replicas first (2 x H200, bench/NOTES.md, Sharding): tp=2 decodes a batch-1 Llama-3-8B
    at 1.3x one GPU's speed and a batch of 64 at 1.3x, where two replicas serve twice one
    GPU's requests; a batch-1 Qwen3-30B-A3B ran slower split over two GPUs (tp=2 3.19, ep=2
    3.40 ms a token) than on one (2.86). So a model split over more GPUs than it needs buys
    latency at a cost per token. plan_kwargs: as `plan_memory`'s. Raises JaxinferError (the
    largest layout's reason) where no layout fits."""
    if gpus < 1:
        raise JaxinferError(f"--gpus {gpus}: expected >= 1")
    error = None
    tp = 1
    while tp <= gpus:
        if gpus % tp == 0:
            spec = MeshSpec(dp=gpus // tp, tp=tp)
            try:
                plan = plan_memory(config, spec, hbm_bytes, name=name, **plan_kwargs)
            except JaxinferError as e:
                error = e
            else:
                if plan.max_seqs >= 1:
                    return spec, plan
                error = JaxinferError(f"{name} on {spec}: no room for one sequence of "
                                      f"{plan.context} tokens ({plan.num_pages} pages)")
        tp *= 2
    raise JaxinferError(f"{name}: no layout of {gpus} device(s) fits ({error})")


def kv_pages(where: str, usable: int, usable_from: str, weights: int, reserve: int,
             page_bytes: int, min_pages: int, min_pages_for: str = "",
             free_block: int | None = None) -> tuple[int, int]:
    """(KV bytes, pages) per device once weights and reserve are out of usable: the KV bytes
    rounded down to KV_ROUNDING_BYTES, the pages they hold less the runner's scratch page.
    free_block: the largest free block of the device's pool, where the weights are loaded:
    the KV arrays, each larger than the holes a load leaves between its arrays, and a
    step's temporaries must fit in it together. Raises a one-line JaxinferError naming
    every figure when fewer than min_pages fit (min_pages_for says what they are for)."""
    if weights > usable:
        raise JaxinferError(
            f"{where}: the weights do not fit: {_size(weights)} per device, {_size(usable)} "
            f"usable ({usable_from}); split them over more devices (tp, ep) or quantize them")
    free = usable - weights
    if free_block is not None and free_block < free:
        free = free_block
        usable_from += f"; the largest free block after the weights {_size(free_block)}"
    kv_bytes = free - reserve
    if kv_bytes >= 2 * KV_ROUNDING_BYTES:
        kv_bytes -= kv_bytes % KV_ROUNDING_BYTES
    num_pages = max(kv_bytes, 0) // page_bytes - 1  # the runner adds a scratch page
    if num_pages < min_pages:
        need = (min_pages + 1) * page_bytes
        raise JaxinferError(
            f"{where}: does not fit: weights {_size(weights)} + activations and workspace "
            f"{_size(reserve)} + KV cache {_size(need)} "
            f"({min_pages_for or f'{min_pages} pages of {_size(page_bytes)}'}) per device, "
            f"{_size(usable)} usable ({usable_from}); lower --max-model-len or "
            "--max-num-batched-tokens, raise --gpu-memory-utilization, split the model over "
            "more devices or quantize it")
    return kv_bytes, num_pages


def set_memory_utilization(fraction: float) -> None:
    """Sizes JAX's device memory pool to `fraction` of each accelerator's memory (vLLM's
    gpu_memory_utilization) through XLA_PYTHON_CLIENT_MEM_FRACTION: only before JAX starts
    its backends, and only where the variable is unset (a user's own setting wins)."""
    from jax._src import xla_bridge

    if not 0 < fraction <= 1:
        raise JaxinferError(f"--gpu-memory-utilization {fraction}: expected a share in (0, 1]")
    if "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ and \
            not xla_bridge.backends_are_initialized():
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{fraction:g}"


def device_memory_held(device: jax.Device) -> tuple[int, int] | None:
    """(bytes in use, the largest free block) of `device`'s memory pool now; None where the
    device reports neither (the CPU). The difference between the pool's free bytes and its
    largest free block is the holes that loading the weights left: their temporaries
    (a float32 draw, the parts of a joined projection) freed between arrays that stay."""
    stats = device.memory_stats()
    if not stats or "bytes_in_use" not in stats or "largest_free_block_bytes" not in stats:
        return None
    return int(stats["bytes_in_use"]), int(stats["largest_free_block_bytes"])


def device_memory_bytes(device: jax.Device, fraction: float) -> tuple[int, str] | None:
    """(bytes the engine may use on `device`, how they were found): `fraction` of its memory,
    within JAX's pool (`bytes_limit`, XLA_PYTHON_CLIENT_MEM_FRACTION of it, 0.75 unless
    set); None where the device reports no memory (the CPU)."""
    stats = device.memory_stats()
    if not stats or not stats.get("bytes_limit"):
        return None
    pool = int(stats["bytes_limit"])
    pool_fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION",
                                         JAX_DEFAULT_MEM_FRACTION))
    usable = min(pool, int(pool / pool_fraction * fraction))
    return usable, (f"{fraction:g} of {_size(int(pool / pool_fraction))}"
                    + (f", JAX's pool {_size(pool)}" if usable == pool else ""))


@dataclasses.dataclass(frozen=True)
class KVCachePlan:
    """What `plan_kv_cache` decided: bytes per device, pages per replica."""

    kv_cache_bytes: int  # per replica, counting every tp device's share: LLM(kv_cache_bytes=)
    num_pages: int
    usable_bytes: int | None  # None on the CPU
    usable_from: str
    weight_bytes: int
    reserve_bytes: int
    page_bytes: int
    step_bytes: int | None = None  # a step's measured need (None: the reserve is estimated)
    step_from: str = ""  # which program that was
    in_use_bytes: int = 0  # the pool's bytes in use when planned (the weights, and the rest)
    free_block_bytes: int | None = None  # its largest free block then (None: not reported)

    def format(self, page_size: int) -> str:
        """One line for the terminal (what vLLM prints as its GPU blocks)."""
        kv = (self.num_pages + 1) * self.page_bytes
        line = (f"KV cache {_size(kv)} per device: {self.num_pages} pages of {page_size} "
                f"tokens ({self.num_pages * page_size} tokens)")
        if self.usable_bytes is None:
            return line + f"; {self.usable_from}"
        step = ("estimated" if self.step_bytes is None else
                f"a step's peak {_size(self.step_bytes)} measured")
        held = ""
        if self.free_block_bytes is not None:
            held = (f" ({_size(self.in_use_bytes)} in use, largest free block "
                    f"{_size(self.free_block_bytes)})")
        return (line + f"; weights {_size(self.weight_bytes)}{held}, reserve "
                f"{_size(self.reserve_bytes)} ({step}), of {_size(self.usable_bytes)} usable "
                f"({self.usable_from})")


def plan_kv_cache(model, mesh: jax.sharding.Mesh, *, page_size: int, max_model_len: int | None,
                  max_num_seqs: int, max_num_batched_tokens: int,
                  memory_utilization: float = DEFAULT_MEMORY_UTILIZATION,
                  name: str = "the model", kv_dtype=None,
                  measure_step: Callable[[], tuple[int, str]] | None = None) -> KVCachePlan:
    """The KV cache of `model` (a `Decoder` on `mesh`, one replica) when the user gives no
    size. On an accelerator the model is loaded: its pool holds, after what is in use (the
    weights) and a step's reserve, the KV cache, which must fit the pool's largest free
    block beside the reserve (`device_memory_held`) and take one sequence of max_model_len
    (default: the model's context). On the CPU (the model loaded or its abstract form: its
    arrays described, `ConvertedCheckpoint.abstract_model`): what max_num_seqs sequences of
    max_model_len need, at most CPU_KV_CACHE_CAP. kv_dtype: the pages' dtype (default the
    model's). measure_step: called on an accelerator only, returns (bytes a step needs
    beyond its arguments on a device, which program that is), e.g. from
    `jaxinfer.engine.memory_profile`; the reserve is then `measured_reserve`, else the
    estimate `default_reserve`."""
    c = model.config
    tp = mesh_axis_size(mesh, "tp")
    dtype = model.embed.embedding.dtype if kv_dtype is None else kv_dtype
    page_bytes = kv_page_bytes(c, page_size, dtype, mesh)
    pages_per_seq = -(-(max_model_len or c.max_position_embeddings) // page_size)
    # This process's first device of the mesh (each process of a multi-host job plans
    # from its own: a replica's devices hold equal shares, and are one kind of chip).
    device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    shares = [array_bytes(math.prod(leaf.sharding.shard_shape(leaf.shape)), leaf.dtype)
              for leaf in jax.tree.leaves(nnx.state(model)) if device in leaf.sharding.device_set]
    weights = sum(shares)
    memory = device_memory_bytes(device, memory_utilization)
    if memory is None:
        num_pages = min(max_num_seqs * pages_per_seq, CPU_KV_CACHE_CAP // page_bytes - 1)
        return KVCachePlan(num_pages * page_bytes * tp, num_pages, None,
                           f"{max_num_seqs} sequence{'s' * (max_num_seqs > 1)} of "
                           f"{pages_per_seq * page_size} tokens, "
                           f"at most {_size(CPU_KV_CACHE_CAP)}", weights, 0, page_bytes)
    usable, usable_from = memory
    held = device_memory_held(device)
    in_use, free_block = (weights, None) if held is None else (max(held[0], weights), held[1])
    if measure_step is None:
        step, step_from = None, "estimated"
        reserve = default_reserve(c, tp, max_num_seqs, max_num_batched_tokens, max(shares))
    else:
        step, step_from = measure_step()
        reserve = measured_reserve(step, max(shares))
    _, num_pages = kv_pages(
        f"{name} on {device.device_kind}", usable, usable_from, in_use, reserve, page_bytes,
        pages_per_seq, f"one sequence of {pages_per_seq * page_size} tokens", free_block)
    return KVCachePlan(num_pages * page_bytes * tp, num_pages, usable, usable_from, weights,
                       reserve, page_bytes, step, step_from, in_use, free_block)


def _size(b: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b} bytes"


def shard_bytes(shape, dtype, split, mesh) -> int:
    """Bytes of one device's shard of an array of `shape` split by mesh PartitionSpec `split`."""
    local = [d // mesh_axis_size(mesh, a) for d, a in zip(shape, tuple(split), strict=False)]
    local += list(shape[len(local):])
    return array_bytes(math.prod(local), dtype)


def array_bytes(num_elements: int, dtype) -> int:
    """Bytes of num_elements of dtype on a device (4-bit types two a byte)."""
    return math.ceil(num_elements * _bits(dtype) / 8)


def _bits(dtype) -> int:
    """Bits per element: 4 for int4 / float4 (two per byte on the device), else 8 * itemsize."""
    import ml_dtypes

    dtype = jnp.dtype(dtype)
    info = ml_dtypes.iinfo if jnp.issubdtype(dtype, jnp.integer) else ml_dtypes.finfo
    try:
        return info(dtype).bits
    except ValueError:  # bool and the like
        return 8 * dtype.itemsize


def _shard_bytes_by_tensor(placer: ParamPlacer, tensors: dict[str, jax.ShapeDtypeStruct]
                           ) -> dict[str, tuple[str, int]]:
    """key -> (dtype name, bytes of one device's shard) of `tensors` (as loaded) once
    `placer` has laid them out on its mesh (an AbstractMesh will do)."""
    out = {}
    for key, t in tensors.items():
        shape = placer.final_shape(key, t.shape) if placer.needs_transform(key) else t.shape
        out[key] = (jnp.dtype(t.dtype).name, shard_bytes(
            tuple(shape), t.dtype, placer.spec(key, tuple(shape)), placer.mesh))
    return out


def weight_bytes_per_device(placer: ParamPlacer, tensors: dict[str, jax.ShapeDtypeStruct]
                            ) -> dict[str, int]:
    """dtype name -> bytes of one device's shards of `tensors` (as loaded) once `placer` has
    laid them out on its mesh (an AbstractMesh will do), largest first."""
    out: dict[str, int] = {}
    for name, size in _shard_bytes_by_tensor(placer, tensors).values():
        out[name] = out.get(name, 0) + size
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def load_holes_per_device(placer: ParamPlacer, tensors: dict[str, jax.ShapeDtypeStruct]) -> int:
    """Free memory a load leaves between the weights on each device, which no KV array can
    use: each layer's q, k and v parts, freed once joined (`models.inference_form`) with
    nothing their size allocated after them. Measured on an H200 (bytes in use against
    the largest free block, `device_memory_held`): Llama-3-8B 1.797 GiB, its q/k/v parts
    1.5; Qwen3-30B-A3B 0.938 GiB, its parts 0.938. `LLM` measures its own pool instead."""
    parts = re.compile(r"layers\.\d+\.attn\.[qkv]_proj\.weight.*")
    return sum(size for key, (_, size) in _shard_bytes_by_tensor(placer, tensors).items()
               if parts.fullmatch(key))


def largest_tensor_bytes_per_device(placer: ParamPlacer,
                                    tensors: dict[str, jax.ShapeDtypeStruct]) -> int:
    """One device's share of the largest of `tensors` once `placer` has laid it out."""
    return max((size for _, size in _shard_bytes_by_tensor(placer, tensors).values()),
               default=0)


def kv_page_bytes(run_config: ModelConfig, page_size: int, dtype, mesh) -> int:
    """One page (a key and a value page in every layer) on one device; run_config: the
    config the model runs with (`sharded_config`)."""
    shape = (1, page_size, run_config.num_kv_heads, run_config.head_dim)
    split = logical_to_mesh(KV_PAGES_AXES, shape, mesh)
    return 2 * run_config.num_layers * shard_bytes(shape, dtype, split, mesh)


def measured_reserve(step_bytes: int, largest_tensor_bytes: int) -> int:
    """Memory kept free of weights and KV pages on each device, for a step whose program
    needs step_bytes beyond its arguments (measured: `jaxinfer.engine.memory_profile`):

      + WORKSPACE_BYTES: a step's inputs, the allocator's rounding, what XLA keeps beside
        its programs;
      + GEMM autotuning for a program compiled while the KV cache is allocated (one the
        warm-up did not make: a longer context, logprobs): the largest weight's share and
        a tenth (see `default_reserve`).
    """
    return WORKSPACE_BYTES + step_bytes + largest_tensor_bytes * 11 // 10


def default_reserve(run_config: ModelConfig, tp: int, max_num_seqs: int,
                    max_num_batched_tokens: int, largest_tensor_bytes: int = 0) -> int:
    """Memory kept free of weights and KV pages on each device, for a step's temporaries:

      512 MiB   XLA / cuBLAS workspaces, compiled programs, a step's inputs;
      + activations: max_num_batched_tokens x (hidden + the widest per-device projection
        output: q/k/v, gate_up of the dense MLP, or the routed copies of the MoE's
        gate_up) float32 values, twice (a layer's input and output are live together);
      + logits: max_num_seqs x vocab float32 values, four times (the logits and the
        sampler's scaled / sorted / softmax copies);
      + GEMM autotuning: XLA times each GEMM's candidate kernels on fresh copies of its
        operands while it compiles a program, the largest weight (`largest_tensor_bytes`,
        one device's share) among them, plus a tenth for its red zones. Programs that
        compile after the KV cache is allocated need that room: without it Qwen3-30B-A3B
        on an H100 stopped with RESOURCE_EXHAUSTED at 609.5 MiB (its LM head, 594 MiB).

    An estimate, for `jaxinfer plan` (which plans for a device it may not run on) and where
    no step was measured (a scanned model); `LLM` measures (`measured_reserve`).
    """
    c = run_config
    widths = [(c.num_heads + 2 * c.num_kv_heads) * c.head_dim // tp]
    if any(not c.is_moe_layer(i) for i in range(c.num_layers)):
        widths.append(2 * c.intermediate_size // tp)
    if c.is_moe:
        widths.append((c.num_experts_per_tok * 2 * c.moe_intermediate_size
                       + 2 * c.shared_expert_intermediate_size) // tp)
    activations = max_num_batched_tokens * (c.hidden_size + max(widths)) * 4 * 2
    logits = max_num_seqs * c.vocab_size * 4 * 4
    return WORKSPACE_BYTES + activations + logits + largest_tensor_bytes * 11 // 10


# -- what a model would load ---------------------------------------------------------------------


def float_tensors(config: ModelConfig, dtype: str = "bfloat16", quantization: str | None = None,
                  quantized: dict | None = None, layout=None) -> dict[str, jax.ShapeDtypeStruct]:
    """Every parameter of `config`'s model at `dtype` (nothing allocated); the decoder-block
    projections quantized to `quantization` if given, or those in `quantized` (key ->
    QuantFormat) to theirs: values [..., N, K], float32 scales [..., K // g, N] (and
    offsets like them for asymmetric formats). layout: `checkpoint_layout(config)`, if at
    hand."""

    if dtype not in DTYPES:
        raise JaxinferError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    fmt = None if quantization in (None, "none") else parse_format(quantization)
    layout = checkpoint_layout(config) if layout is None else layout
    out = {}
    for key, (shape, _) in layout.items():
        f = fmt if fmt is not None and is_quantizable(key) else (quantized or {}).get(key)
        if f is None:
            out[key] = jax.ShapeDtypeStruct(shape, DTYPES[dtype])
            continue
        *stack, n, k = shape
        if f.group_size and k % f.group_size:
            raise JaxinferError(f"--quantize {f}: tensor {key} has in_features K={k}, not a "
                                f"multiple of the group size {f.group_size}")
        scales = jax.ShapeDtypeStruct((*stack, k // (f.group_size or k), n), jnp.float32)
        out[key] = jax.ShapeDtypeStruct(shape, VALUE_DTYPES[f.kind])
        out[key + SCALE] = scales
        if f.asymmetric:
            out[key + OFFSET] = scales
    return out


def model_tensors(model: str, dtype: str | None = None, quantization: str | None = None
                  ) -> tuple[ModelConfig, dict[str, jax.ShapeDtypeStruct]]:
    """(config, parameters as loaded) of a preset name or a checkpoint path, read without
    loading any weights.

    A converted checkpoint: its stored shapes and dtypes (Orbax metadata), floats cast to
    `dtype` if given, as `load_model` does. An HF directory or .gguf file: floats at `dtype`
    (default bfloat16) and its own quantized tensors as they load (a GGUF's Q4_0 / Q4_1 /
    Q8_0 projections, gpt-oss MXFP4 experts, the NVFP4 / FP8 projections of a quantized HF
    checkpoint). A preset: floats at `dtype`. `quantization`
    (not for converted checkpoints) plans the projections quantized as `jaxinfer convert
    --quantize` would store them.
    """

    if model in PRESETS:
        return PRESETS[model], float_tensors(PRESETS[model], dtype or "bfloat16", quantization)
    path = Path(model)
    if not path.exists():
        raise JaxinferError(f"--model {model!r}: not a preset ({', '.join(PRESETS)}) nor an "
                            "existing path")
    if checkpoint.is_converted(path):
        if quantization is not None:
            raise JaxinferError(f"{path}: a converted checkpoint is planned as stored; "
                                "--quantize applies to presets and HF / GGUF sources")
        return _converted_tensors(path, dtype)
    source = checkpoint.open_source(path)
    native = {} if quantization is not None else _native_formats(source)
    return source.config, float_tensors(source.config, dtype or "bfloat16", quantization,
                                        native)


def _converted_tensors(path: Path, dtype: str | None):

    config = ModelConfig.from_json_file(path / checkpoint.CONFIG_FILE)
    weights_dir = path / checkpoint.WEIGHTS_DIR
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Orbax's experimental-API notices
            stored = checkpoint._ocp().metadata(weights_dir.absolute()).metadata
    except Exception as e:
        raise JaxinferError(f"{weights_dir}: cannot read checkpoint metadata ({e})") from None
    checkpoint._check_stored(weights_dir, checkpoint.expected_shapes(config), stored)
    if dtype is not None and dtype not in checkpoint.DTYPES:
        raise JaxinferError(f"--dtype {dtype!r}: expected one of {', '.join(checkpoint.DTYPES)}")
    return config, {k: jax.ShapeDtypeStruct(tuple(m.shape),
                                            checkpoint._restore_dtype(k, m.dtype, dtype, stored))
                    for k, m in stored.items()}


def _native_formats(source) -> dict:
    """key -> QuantFormat of the tensors a source loads quantized (names only; no data read)."""
    out = {}
    if isinstance(source, GGUFSource):
        formats = {"Q4_0": "int4:g32", "Q4_1": "int4:g32:asym", "Q8_0": "int8:g32"}
        for t in source.reader.tensors:
            key, kind = gguf_key(t.name), t.tensor_type.name
            if key is not None and kind in formats and is_quantizable(key):
                out[key] = parse_format(formats[kind])
        return out

    mxfp4 = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)_blocks")
    scheme = source.scheme  # projections stored quantized: those with the scheme's scales
    scaled = scheme and re.compile(r"(model\.layers\.\d+\..+\.)" + scheme.scales[0])
    for file in source.files:
        try:
            with safe_open(file, framework="numpy") as f:
                names = list(f.keys())
        except Exception as e:
            raise JaxinferError(f"{file}: truncated or corrupt safetensors file ({e})") from None
        for name in names:
            if m := mxfp4.fullmatch(name):
                out[f"layers.{m[1]}.mlp.experts.{m[2]}.weight"] = parse_format("mxfp4")
            elif scaled and (m := scaled.fullmatch(name)):
                key = hf_key(m[1] + "weight") or expert_stack_key(m[1] + "weight")
                if key:
                    out[key] = parse_format(scheme.format)
    return out
