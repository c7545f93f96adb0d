"""Sharding on 8 CPU devices (conftest): tensor, expert and data parallel runs give the
unsharded model's logits (float32, 1e-5) and greedy text; mesh specs and bad splits fail
cleanly; two real processes (`jax.distributed`, CPU collectives) run one sharded generation.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from click.testing import CliRunner

from jaxinfer import LLM, SamplingParams
from jaxinfer.cli.main import cli
from jaxinfer.config import ModelConfig
from jaxinfer.engine.engine import ReplicatedEngine
from jaxinfer.errors import JaxinferError
from jaxinfer.loading.checkpoint import convert, load_model, model_placer, shard_model
from jaxinfer.loading.presets import preset_config, random_model
from jaxinfer.models import inference_form, layers
from jaxinfer.models.inference_form import checkpoint_layout, inference_model
from jaxinfer.models.layers import FoldedRMSNorm, RMSNorm
from jaxinfer.models.moe import FoldedRouter, Router
from jaxinfer.ops.attention import AttentionMetadata
from jaxinfer.sharding import MeshSpec

from .conftest import VOCAB, gpu_llama_config

KV_BYTES = 1 << 22


def _prompts(seed=0, lengths=(7, 19, 3, 33)):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, VOCAB, n).tolist() for n in lengths]


def _max_error(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    assert [x.shape for x in a] == [y.shape for y in b]
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def unsharded_logits():
    cache = {}

    def get(path, prompts):
        key = (str(path), json.dumps(prompts))
        if key not in cache:
            cache[key] = LLM(path, dtype="float32", kv_cache_bytes=KV_BYTES).logits(prompts)
        return cache[key]

    return get


def test_eight_devices():
    assert jax.device_count() == 8  # the conftest flag took effect


@pytest.mark.parametrize("mesh", ["tp=1", "tp=2", "tp=4"])
def test_dense_tensor_parallel_logits(hf_models, unsharded_logits, mesh):
    """llama (4 heads, 2 KV heads): tp=4 repeats each KV head on two devices."""
    prompts = _prompts()
    llm = LLM(hf_models["llama"], dtype="float32", kv_cache_bytes=KV_BYTES, mesh=mesh)
    tp = MeshSpec.parse(mesh).tp
    assert llm.runner.mesh.size == tp
    assert llm.config.num_kv_heads == max(2, tp)
    attn = llm.model.layers[0].attn  # q/k/v joined per shard by the loader
    qkv = attn.qkv_proj.linears[0].weight[...]
    assert len(qkv.sharding.device_set) == tp
    assert {s.data.shape for s in qkv.addressable_shards} == {(qkv.shape[0] // tp, qkv.shape[1])}
    assert attn.qkv_proj.sizes == (4 * 16, max(2, tp) * 16, max(2, tp) * 16)
    k_pages = llm.runner.kv_cache[0][0]
    assert {s.data.shape[2] for s in k_pages.addressable_shards} == {llm.config.num_kv_heads // tp}
    got = llm.logits(prompts)
    assert not any(np.isnan(x).any() for x in got)
    assert _max_error(got, unsharded_logits(hf_models["llama"], prompts)) < 1e-5


@pytest.mark.parametrize("family, mesh", [
    ("qwen3_moe", "ep=2"), ("qwen3_moe", "ep=4"), ("qwen3_moe", "tp=2,ep=2"),
    ("gpt_oss", "tp=2,ep=2"),  # sinks, expert biases (added once under tp), clamped SwiGLU
    ("qwen2_moe", "tp=2"),  # a shared expert and a dense layer, experts split by columns
])
def test_moe_expert_parallel_logits(hf_models, unsharded_logits, family, mesh):
    prompts = _prompts(1)
    llm = LLM(hf_models[family], dtype="float32", kv_cache_bytes=KV_BYTES, mesh=mesh)
    spec = MeshSpec.parse(mesh)
    gate_up = llm.model.layers[0].mlp.experts.gate_up_proj.weight[...]
    e, n, k = gate_up.shape
    assert {s.data.shape for s in gate_up.addressable_shards} == {(e // spec.ep, n // spec.tp, k)}
    assert _max_error(llm.logits(prompts), unsharded_logits(hf_models[family], prompts)) < 1e-5


@pytest.mark.parametrize("family, fmt, mesh", [
    ("llama", "int4:g32", "tp=2"),  # row-split projections: 2 groups of 32 per device
    ("qwen3_moe", "int8", "tp=2,ep=2"),
])
def test_quantized_checkpoint_sharded_restore(hf_models, tmp_path, family, fmt, mesh):
    """A converted quantized checkpoint: Orbax restores each shard onto its device, and the
    quantized kernels run per device on their shards."""
    ckpt = convert(hf_models[family], tmp_path / "q", dtype="float32", quantize=fmt)
    prompts = _prompts(2)
    one = LLM(ckpt, kv_cache_bytes=KV_BYTES).logits(prompts)
    llm = LLM(ckpt, kv_cache_bytes=KV_BYTES, mesh=mesh)
    layer = llm.model.layers[1]
    proj = layer.attn.o_proj if family == "llama" else layer.mlp.experts.down_proj
    assert proj.quantized and len(proj.weight[...].sharding.device_set) > 1
    assert _max_error(llm.logits(prompts), one) < 1e-5


@pytest.mark.parametrize("family, mesh", [("llama", "tp=2"), ("qwen3_moe", "tp=2,ep=2"),
                                          ("llama", "tp=2,dp=2")])
def test_engine_greedy_text_sharded(hf_models, family, mesh):
    """Continuous batching with multi-step decode on a mesh (and dp replicas behind one
    engine) generates the unsharded engine's greedy text; every page comes back."""
    prompts = _prompts(3, (5, 21, 12, 40, 9))
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0)
    kw = dict(dtype="float32", kv_cache_bytes=KV_BYTES, decode_steps=4, max_num_seqs=4)
    want = [o.token_ids for o in LLM(hf_models[family], **kw).generate(prompts, params)]
    llm = LLM(hf_models[family], mesh=mesh, **kw)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    engines = llm.engine.engines if isinstance(llm.engine, ReplicatedEngine) else [llm.engine]
    assert len(engines) == len(llm.engine.runners) == MeshSpec.parse(mesh).dp
    if len(engines) > 1:  # both replicas took requests
        assert all(e.num_steps > 0 for e in engines)
    assert all(e.stats().num_free_pages == e.runner.num_pages for e in engines)


def test_mesh_spec_parse_and_errors():
    assert MeshSpec.parse("tp=2, ep=4") == MeshSpec(dp=1, ep=4, tp=2)
    assert MeshSpec.parse(None) == MeshSpec()
    for bad in ("tp=0", "tp=2,tp=2", "pp=2", "tp"):
        with pytest.raises(JaxinferError, match="--mesh"):
            MeshSpec.parse(bad)
    with pytest.raises(JaxinferError, match="needs 16 devices, 8 visible"):
        MeshSpec.parse("tp=4,dp=4").meshes()
    with pytest.raises(JaxinferError, match="num_heads=4 is not divisible by tp=8"):
        MeshSpec(tp=8).check(preset_config("tiny"))
    with pytest.raises(JaxinferError, match="ep=2 needs a mixture-of-experts model"):
        MeshSpec(ep=2).check(preset_config("tiny"))
    config = ModelConfig(**{**preset_config("tiny").__dict__, "num_heads": 6, "num_kv_heads": 6})
    with pytest.raises(JaxinferError, match="num_kv_heads=6 neither divides"):
        MeshSpec(tp=4).check(config)


def test_cli_mesh_errors_are_one_line(hf_models):
    result = CliRunner().invoke(cli, ["generate", "--model", str(hf_models["llama"]),
                                      "--prompt", "hi", "--mesh", "tp=8"])
    assert result.exit_code == 1
    assert result.output.startswith("Error: --mesh tp=8,ep=1,dp=1: ")
    assert len(result.output.strip().splitlines()) == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_generate_together(hf_models):
    """Two processes of two CPU devices each form one tp=4 mesh: process 0 schedules and
    broadcasts every step, planning each while the one before runs (overlap), process 1
    follows; both sample the same tokens, which equal the single-process unsharded run's."""
    path = hf_models["llama"]
    prompt = _prompts(4, (11,))[0]
    want = LLM(path, dtype="float32", kv_cache_bytes=KV_BYTES).generate(
        [prompt], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))[0].token_ids
    driver = Path(__file__).with_name("multihost_driver.py")
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, str(driver), str(path), "tp=4", coordinator,
                               str(i), json.dumps(prompt), "8"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    assert outs[0]["overlap"]
    assert outs[0]["tokens"] == want
    assert outs[1]["tokens"] == want


@pytest.mark.gpu
@pytest.mark.parametrize("mesh", ["tp=2"])
def test_gpu_sharded_kernels_match_one_device(mesh):
    """On GPUs (bf16, the Mosaic attention and quantized-matmul kernels inside shard_map):
    the split model's logits match one device's to bf16 rounding."""
    import jax.numpy as jnp

    if jax.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    config = gpu_llama_config()
    model = random_model(config, jnp.bfloat16, seed=5)
    prompts = _prompts(6, (37, 300, 5))
    want = LLM(model, kv_cache_bytes=64 << 20).logits(prompts)
    got = LLM(model, kv_cache_bytes=64 << 20, mesh=mesh).logits(prompts)
    scale = max(float(np.abs(x).max()) for x in want)
    assert _max_error(got, want) < 0.02 * scale


def test_server_with_replicas_and_tensor_parallel(qwen3_converted, tmp_path):
    """`jaxinfer serve --mesh tp=2,dp=2`: concurrent requests spread over two replicas give
    the unsharded model's greedy tokens, and every page comes back."""
    from concurrent.futures import ThreadPoolExecutor

    from .test_server import _start, _wait_ready

    prompts = _prompts(7, (4, 30, 11, 17, 25, 8))
    want = [o.token_ids for o in LLM(qwen3_converted, kv_cache_bytes=KV_BYTES).generate(
        prompts, SamplingParams(max_tokens=6, ignore_eos=True, temperature=0))]
    log = tmp_path / "server.log"
    proc = _start(qwen3_converted, log, 64, "--mesh", "tp=2,dp=2")
    try:
        server = _wait_ready(proc, log, None)

        def complete(prompt):
            resp = server.client.completions.create(
                model=str(qwen3_converted), prompt=prompt, max_tokens=6, temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": True})
            return resp.choices[0].model_extra["token_ids"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(complete, prompts)) == want
        metrics = server.wait_idle()
        assert metrics["jaxinfer_kv_pages_in_use"] == 0
        assert metrics["jaxinfer_kv_pages_total"] == 2 * 64  # two replicas of 64 pages
    finally:
        proc.terminate()
        proc.wait(30)


def without_gloo_notices(text: str) -> str:
    """text without the words of gloo's own notices ("[Gloo] Rank 3 is connected to 3 peer
    ranks. Expected number of connected peer ranks is : 3", printed wherever the output
    stands), and without digits and line breaks: a process's local ranks print their
    notices at once, so the pieces of two may interleave anywhere between words."""
    for words in ("[Gloo] Rank ", " is connected to ", " peer ranks. ",
                  "Expected number of connected peer ranks is : "):
        text = text.replace(words, "")
    return re.sub(r"[\d\n]", "", text)


def test_two_processes_cli_generate(hf_models):
    """`jaxinfer generate` as a two-process job configured from the environment
    (JAXINFER_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID): process 0 prints the text of the
    single-process run, process 1 prints nothing, both exit 0."""
    import os

    path = str(hf_models["llama"])
    args = ["-m", "jaxinfer.cli.main", "generate", "--model", path, "--prompt", "The theory",
            "--max-new-tokens", "6", "--dtype", "float32"]
    alone = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                           timeout=300)
    assert alone.returncode == 0, alone.stderr[-2000:]
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen(
        [sys.executable, *args, "--mesh", "tp=4"], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
             "JAXINFER_COORDINATOR": coordinator, "JAXINFER_NUM_PROCESSES": "2",
             "JAXINFER_PROCESS_ID": str(i)}) for i in range(2)]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        outs.append(without_gloo_notices(stdout))
    assert outs[0] == without_gloo_notices(alone.stdout) and outs[0].startswith("The theory")
    assert outs[1] == ""


def _logits(model, mesh, tokens: list[int]) -> np.ndarray:
    """float32 logits [T, vocab] of one sequence of T tokens through `model` (placed on
    `mesh`) from an empty cache, one jitted forward."""
    import jax.numpy as jnp
    from flax import nnx

    c, T, page = model.config, len(tokens), 8
    pages = -(-T // page)
    md = AttentionMetadata(cu_q_lens=jnp.array([0, T]), kv_lens=jnp.array([T]),
                           page_indices=jnp.arange(pages)[None], num_seqs=jnp.array([1]))
    kv = [(jnp.zeros((pages + 1, page, c.num_kv_heads, c.head_dim)),) * 2
          for _ in range(c.num_layers)]
    graphdef, state = nnx.split(model)

    def forward(state):
        m = nnx.merge(graphdef, state)
        return m.logits(m(jnp.asarray(tokens, jnp.int32), jnp.arange(T), kv, md)[0])

    with jax.set_mesh(mesh):
        return np.asarray(jax.jit(forward)(state))


@pytest.mark.parametrize("preset, mesh", [("tiny", "tp=1"), ("tiny", "tp=2"),
                                          ("tiny", "tp=4"), ("tiny-moe", "tp=2,ep=2")])
def test_inference_form_computes_the_checkpoint_projections(monkeypatch, preset, mesh):
    """`inference_model` (q/k/v and gate/up joined per shard into one GEMM each, the norm
    scales folded into them or into the MoE router) computes what the same checkpoint
    tensors compute unjoined (one Linear per projection, concatenated per shard for
    attention) behind plain norms, on every mesh (tp=4 > 2 KV heads: the repeated k/v rows
    join too). The norm scales are drawn from [0.5, 2] (a checkpoint's start as ones), so a
    scale folded into the wrong axis, or not applied, fails."""

    config = preset_config(preset)
    jax_mesh = MeshSpec.parse(mesh).meshes()[0]
    placer = model_placer(config, jax_mesh)
    rng = np.random.default_rng(7)
    tensors = {key: (rng.uniform(0.5, 2.0, t.shape) if len(t.shape) == 1  # norm scales
                     else rng.normal(0, 0.05, t.shape)).astype(np.float32)
               for key, t in checkpoint_layout(config).items()}

    def build():
        return inference_model(placer.model_config,
                               {key: placer.place(key, a) for key, a in tensors.items()})

    model = build()
    layer = model.layers[0]
    assert len(layer.attn.qkv_proj.linears) == 1 and isinstance(layer.input_norm, FoldedRMSNorm)
    if preset == "tiny":
        assert len(layer.mlp.gate_up_proj.linears) == 1
        assert isinstance(layer.post_attn_norm, FoldedRMSNorm)
    else:  # the experts read the normalised input; the router holds the scale
        assert type(layer.post_attn_norm) is RMSNorm and type(layer.mlp.router) is FoldedRouter
    monkeypatch.setattr(layers, "join_linears", lambda parts: None)
    monkeypatch.setattr(inference_form, "foldable", lambda parts: False)
    unjoined = build()
    layer = unjoined.layers[0]
    assert len(layer.attn.qkv_proj.linears) == 3 and type(layer.input_norm) is RMSNorm
    if preset != "tiny":
        assert type(layer.mlp.router) is Router
    tokens = _prompts(lengths=(21,))[0]
    want = _logits(unjoined, jax_mesh, tokens)
    assert np.isfinite(want).all() and np.abs(want).max() > 0.1
    np.testing.assert_allclose(_logits(model, jax_mesh, tokens), want, rtol=1e-5, atol=1e-5)


def test_loaded_model_is_in_inference_form_and_moves_exactly(hf_models):
    """`load_model` gives the model as it runs: q/k/v and gate/up one Linear each (no
    per-projection layer left), float norms folded (the MoE block's into its router).
    `shard_model` moves it exactly: from one device to tp=4 (KV heads repeated) every
    parameter equals the tp=4 load's, and a replica on other devices of the same tp gives
    bit-identical logits."""
    from flax import nnx

    path = hf_models["qwen2_moe"]  # layer 0: MoE with a shared expert; layer 1: dense
    one = load_model(path, dtype="float32")
    for layer in one.layers:
        assert len(layer.attn.qkv_proj.linears) == 1
        assert layer.attn.qkv_proj.linears[0].bias is not None  # qwen2: q/k/v biases
        assert not hasattr(layer.attn, "q_proj") and isinstance(layer.input_norm, FoldedRMSNorm)
    moe_layer, dense_layer = one.layers
    assert type(moe_layer.post_attn_norm) is RMSNorm
    assert type(moe_layer.mlp.router) is FoldedRouter
    assert len(moe_layer.mlp.shared_expert.gate_up_proj.linears) == 1
    assert len(dense_layer.mlp.gate_up_proj.linears) == 1
    assert isinstance(dense_layer.post_attn_norm, FoldedRMSNorm)

    meshes = MeshSpec.parse("tp=4,dp=2").meshes()
    loaded = load_model(path, dtype="float32", mesh=meshes[0])
    moved = shard_model(one, meshes[0])
    assert nnx.graphdef(moved) == nnx.graphdef(loaded)
    want = dict(nnx.state(loaded, nnx.Param).flat_state())
    got = dict(nnx.state(moved, nnx.Param).flat_state())
    assert got.keys() == want.keys()
    for key, var in want.items():
        assert got[key][...].sharding == var[...].sharding, key
        np.testing.assert_array_equal(np.asarray(got[key][...]), np.asarray(var[...]),
                                      err_msg=str(key))
    tokens = _prompts(8, (19,))[0]
    replica = shard_model(loaded, meshes[1])
    assert {d for v in nnx.state(replica, nnx.Param).flat_state() for d in
            v[1][...].sharding.device_set} == set(meshes[1].devices.flat)
    np.testing.assert_array_equal(_logits(replica, meshes[1], tokens),
                                  _logits(loaded, meshes[0], tokens))


def test_int4_projections_stored_in_the_hopper_kernels_order(monkeypatch):
    """On Hopper the loader stores int4 projections (groups of 64 or more) in the Mosaic
    kernel's chunk order (`kernel_k_order`) where each device's input features are whole
    64-column tiles: at tp=1 every projection of the tiny model, at tp=2 all but o (32
    input features a device). The model computes the logits of the same weights kept in
    K's order (here the reference permutes x instead), `checkpoint_params` gives K's order
    back exactly, and `shard_model` from tp=1 to tp=2 takes the order apart and stores it
    again as a tp=2 load does."""
    import functools

    import jax.numpy as jnp
    from flax import nnx

    from jaxinfer.models.inference_form import checkpoint_params
    from jaxinfer.ops.linear_registry import kernel_k_order

    config = preset_config("tiny")
    one, two = (MeshSpec.parse(m).meshes()[0] for m in ("tp=1", "tp=2"))
    tokens = _prompts(lengths=(19,))[0]

    def orders(model):
        return {"/".join(map(str, path)): node.k_order for path, node in nnx.iter_graph(model)
                if isinstance(node, layers.Linear) and node.quantized}

    def build(mesh):
        return random_model(config, jnp.bfloat16, seed=3, mesh=mesh, quantize="int4:g64")

    plain = {1: build(one), 2: build(two)}
    monkeypatch.setattr(inference_form, "kernel_k_order",
                        functools.partial(kernel_k_order, on="hopper"))
    hopper = {1: build(one), 2: build(two)}
    assert set(orders(plain[1]).values()) == {None}
    assert set(orders(hopper[1]).values()) == {"chunks"}
    assert {path: order for path, order in orders(hopper[2]).items()
            if order is None} == {f"layers/{i}/attn/o_proj": None for i in range(2)}
    moved = shard_model(hopper[1], two)
    assert orders(moved) == orders(hopper[2])
    for tp, mesh in ((1, one), (2, two)):
        want = _logits(plain[tp], mesh, tokens)
        assert np.isfinite(want).all() and np.abs(want).max() > 0.1
        for model in (hopper[tp], *((moved,) if tp == 2 else ())):
            got = _logits(model, mesh, tokens)
            assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()
        params, base = checkpoint_params(hopper[tp]), checkpoint_params(plain[tp])
        assert params.keys() == base.keys()
        for key in base:
            np.testing.assert_array_equal(np.asarray(params[key].astype(jnp.float32)),
                                          np.asarray(base[key].astype(jnp.float32)), key)
