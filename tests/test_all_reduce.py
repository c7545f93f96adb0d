"""The peer-memory all-reduce (`jaxinfer.mosaic.all_reduce`) and where `reduce_over` uses it.

On CPUs (8 fake devices, conftest): the kernel lowers for Hopper without XLA's collective
metadata (no barrier kernel, no address exchange a run), and `reduce_over` picks it for
decode-sized sums over the whole mesh only. On 2 GPUs (`pytest -m gpu`): the kernel against
a float64 sum, the same bits on every device, over calls that alternate its two stages;
and a tp=2 model's greedy decode with it gives bitwise the tokens and logprobs it gives
with XLA's all-reduce (a sum of two bf16 values rounds the same either way).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer.errors import JaxinferError
from jaxinfer.mosaic import all_reduce
from jaxinfer.sharding import (
    PEER_ALL_REDUCE_MAX_BYTES,
    PeerAllReduce,
    peer_all_reduce,
    peer_all_reduce_capacity,
    reduce_over,
    shard_map_logical,
)


def _mesh(n: int):
    return jax.make_mesh((n,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:n])


def _lowered_text(fn, *avals) -> str:
    return jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("n,tokens,dtype", [(2, 1, jnp.bfloat16), (4, 16, jnp.float32)])
def test_kernel_lowers_for_hopper_without_collective_metadata(n, tokens, dtype):
    """The compiled (not interpreted) kernel lowers for a CUDA device from the CPU, as a
    plain Mosaic kernel: XLA adds no barrier kernel and exchanges no addresses for it."""
    mesh = _mesh(n)
    fn = jax.shard_map(functools.partial(all_reduce.all_reduce_sum, axis_name="tp",
                                         capacity=1 << 20),
                       mesh=mesh, in_specs=(P("tp"), P()), out_specs=P("tp"), check_vma=False)
    x = jax.ShapeDtypeStruct((n * tokens, 4096), dtype, sharding=NamedSharding(mesh, P("tp")))
    peers = jax.ShapeDtypeStruct((n, 2), jnp.uint32, sharding=NamedSharding(mesh, P()))
    text = _lowered_text(fn, x, peers)
    assert len(re.findall(r"custom_call @mosaic_gpu_v2", text)) == 1
    assert "uses_xla_collective_metadata = false" in text
    assert "xla_replica_ids" not in text


def test_supports():
    tile = all_reduce.tile_elements(jnp.bfloat16)
    assert tile == 1024 and all_reduce.tile_elements(jnp.float32) == 512
    assert all_reduce.supports((2, 4096), jnp.bfloat16, 16384)
    assert not all_reduce.supports((3, 4096), jnp.bfloat16, 16384)  # past the capacity
    assert not all_reduce.supports((1, 576), jnp.bfloat16, 1 << 20)  # not whole tiles
    assert not all_reduce.supports((1, 4096), jnp.int32, 1 << 20)
    with pytest.raises(ValueError, match="multiple of 16384"):
        all_reduce.make_workspace(_mesh(2), 1000)  # a stride that breaks 16-byte stores


@pytest.mark.parametrize("tokens,peer,ep", [(1, True, 1), (32, True, 1), (64, False, 1),
                                             (1, False, 2)])
def test_reduce_over_picks_the_peer_kernel_for_decode_sizes(tokens, peer, ep):
    """Under `peer_all_reduce` a sum over the whole mesh of a message within the capacity
    is the peer kernel; a larger one, a sum over part of the mesh (tp of an ep x tp mesh:
    two groups would share each device's workspace), or none configured, is XLA's."""
    mesh = jax.make_mesh((ep, 2), ("ep", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:2 * ep])
    capacity = 32 * 4096 * 2

    def step(x, peers, config):
        with peer_all_reduce(PeerAllReduce(peers, capacity) if config else None):
            return shard_map_logical(lambda h: reduce_over(("mlp",), h),
                                     (P("batch", "mlp"),), P("batch", None), x)

    x = jax.ShapeDtypeStruct((tokens, 8192), jnp.bfloat16)
    peers = jax.ShapeDtypeStruct((2 * ep, 2), jnp.uint32)
    for config in (True, False):
        with jax.set_mesh(mesh):
            text = _lowered_text(functools.partial(step, config=config), x, peers)
        kernels = len(re.findall(r"custom_call @mosaic_gpu_v2", text))
        all_reduces = len(re.findall(r"stablehlo.all_reduce", text))
        assert (kernels, all_reduces > 0) == ((1, False) if peer and config else (0, True))


def test_all_reduce_setting(monkeypatch):
    """JAXINFER_ALL_REDUCE: peer / xla / a size; anything else, or a size the kernel would
    unroll too far, is a one-line error; off on CPUs whatever it says."""
    mesh = _mesh(2)
    for setting in ("peer", "xla", "0", "65536"):
        monkeypatch.setenv("JAXINFER_ALL_REDUCE", setting)
        assert peer_all_reduce_capacity(mesh) == 0  # CPUs
    for bad in ("nccl", "-5", str(PEER_ALL_REDUCE_MAX_BYTES + 1)):
        monkeypatch.setenv("JAXINFER_ALL_REDUCE", bad)
        with pytest.raises(JaxinferError, match="JAXINFER_ALL_REDUCE"):
            peer_all_reduce_capacity(mesh)


def _two_gpus():
    if jax.default_backend() != "gpu" or jax.device_count() < 2:
        pytest.skip("needs 2 GPUs")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_kernel_is_one_rounding_of_the_exact_sum(dtype):
    """Two programs of 8 independent sums each (1 to 32 tokens of 4096, fresh random
    inputs), dispatched in turn six times with no wait between them, so a device may run
    ahead of the other and the stages alternate: every sum is bitwise the two inputs added
    in float32 and rounded once, on both devices."""
    _two_gpus()
    mesh = _mesh(2)
    hidden = 4096
    workspace = all_reduce.make_workspace(mesh, 32 * hidden * jnp.dtype(dtype).itemsize)
    reduce = functools.partial(all_reduce.all_reduce_sum, axis_name="tp",
                               capacity=workspace.capacity)

    def sums(xs, peers):
        return [reduce(x, peers) for x in xs]

    program = jax.jit(jax.shard_map(sums, mesh=mesh, in_specs=(P("tp"), P()),
                                    out_specs=P("tp"), check_vma=False))
    rng = np.random.default_rng()
    runs = []
    for round_ in range(6):
        tokens = (1, 3, 16, 32, 1, 8, 32, 2) if round_ % 2 else (32, 1, 4, 32, 16, 1, 2, 8)
        xs = [jax.device_put(jnp.asarray(rng.standard_normal((2 * t, hidden)), dtype),
                             NamedSharding(mesh, P("tp"))) for t in tokens]
        runs.append((xs, program(xs, workspace.peers)))
    for xs, ys in runs:
        for x, y in zip(xs, ys, strict=True):
            parts = np.asarray(x.astype(jnp.float32)).reshape(2, -1, hidden)
            want = (parts[0] + parts[1]).astype(dtype)  # float32 add, one rounding
            got = np.asarray(y).reshape(2, -1, hidden)
            np.testing.assert_array_equal(got[0], want)
            np.testing.assert_array_equal(got[1], want)


@pytest.mark.gpu
def test_gpu_decode_with_the_peer_kernel_matches_xla_all_reduce(monkeypatch):
    """A tp=2 bf16 model's greedy decode (multi-step loops, the prompts' prefill beside
    them): bitwise the tokens and logprobs with the peer all-reduce as with XLA's."""
    _two_gpus()
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.engine.scheduler import SeqChunk
    from jaxinfer.loading.presets import random_model

    from .conftest import gpu_llama_config

    config = gpu_llama_config()
    model = random_model(config, jnp.bfloat16, seed=7)
    rng = np.random.default_rng()
    prompts = [rng.integers(2, 2048, n).tolist() for n in (5, 40, 17, 90)]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=1, ignore_eos=True)
    runs, kernels = {}, {}
    for mode in ("peer", "xla"):
        monkeypatch.setenv("JAXINFER_ALL_REDUCE", mode)
        llm = LLM(model, kv_cache_bytes=64 << 20, mesh="tp=2", decode_steps=8)
        assert bool(llm.runner.peer_capacity) == (mode == "peer")
        outs = llm.generate(prompts, params)
        runs[mode] = [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]
        # The multi-step decode program of 4 sequences: its Mosaic kernels, sums included.
        runner = llm.runner
        chunks = [SeqChunk(new_tokens=[0], num_cached=100, pages=[], remaining=8)] * 4
        shape = runner.step_shape(chunks, 8)
        text = runner.steps._lower(shape, *runner.example_args(shape)).as_text()
        kernels[mode] = text.count("custom_call @mosaic_gpu_v2")
    assert runs["peer"] == runs["xla"]
    # 2 sums a layer and the embedding's: the peer kernel ran them, not NCCL.
    assert kernels["peer"] >= kernels["xla"] + 2 * 2 + 1
