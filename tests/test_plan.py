"""The memory planner (`jaxinfer plan`) against real allocations on 8 CPU devices (conftest):
weight bytes per device of presets and of a quantized converted checkpoint, KV page bytes
per device of the runner's cache; the command's output and its one-line errors.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from flax import nnx

from jaxinfer import LLM, SamplingParams
from jaxinfer.cli.main import cli
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.errors import JaxinferError
from jaxinfer.loading import checkpoint
from jaxinfer.loading import plan as plan_module
from jaxinfer.loading.plan import (
    KV_ROUNDING_BYTES,
    GiB,
    float_tensors,
    model_tensors,
    plan_memory,
    suggest_mesh,
)
from jaxinfer.loading.presets import preset_config, random_model
from jaxinfer.sharding import MeshSpec

HBM = 64 * GiB


def _mesh(spec: str):
    s = MeshSpec.parse(spec)
    if jax.device_count() < s.size:
        pytest.skip(f"needs {s.size} devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return s.meshes()[0]


def _bytes_per_device(arrays, mesh) -> list[int]:
    """Bytes each device of `mesh` holds of `arrays` (its shards' real allocation)."""
    per = {d: 0 for d in mesh.devices.flat}
    for a in arrays:
        for shard in a.addressable_shards:
            per[shard.device] += shard.data.on_device_size_in_bytes()
    return list(per.values())


def _param_bytes(model, mesh) -> list[int]:
    return _bytes_per_device(jax.tree.leaves(nnx.state(model, nnx.Param)), mesh)


CASES = [("tiny", "tp=1"), ("tiny", "tp=2"), ("tiny", "tp=4"),  # tp=4: KV heads repeated
         ("tiny-moe", "ep=2"), ("tiny-moe", "tp=2,ep=2")]


@pytest.mark.parametrize("preset, spec", CASES)
def test_weight_bytes_match_allocation(preset, spec):
    mesh = _mesh(spec)
    config = preset_config(preset)
    plan = plan_memory(config, spec, HBM, dtype="float32", name=preset)
    per_device = _param_bytes(random_model(config, jnp.float32, mesh=mesh), mesh)
    assert plan.weight_bytes == max(per_device)
    assert plan.weight_bytes_by_dtype == {"float32": plan.weight_bytes}
    if MeshSpec.parse(spec).replica_size > 1:  # really split, not a whole copy per device
        whole = plan_memory(config, "tp=1", HBM, dtype="float32").weight_bytes
        assert plan.weight_bytes < whole


@pytest.mark.parametrize("preset, spec", CASES)
def test_kv_page_bytes_match_runner(preset, spec):
    mesh = _mesh(spec)
    config = preset_config(preset)
    plan = plan_memory(config, spec, HBM, dtype="float32")
    num_pages = 5
    runner = ModelRunner(random_model(config, jnp.float32, mesh=mesh), num_pages, 16, 256,
                         mesh=mesh)
    per_device = _bytes_per_device(jax.tree.leaves(runner.kv_cache), mesh)
    assert len(set(per_device)) == 1
    assert plan.page_bytes * (num_pages + 1) == per_device[0]  # + the scratch page
    # The LLM argument the plan names gets exactly its pages.
    c = runner.config
    assert plan.kv_cache_bytes // (2 * c.num_layers * 16 * c.num_kv_heads * c.head_dim * 4) \
        == plan.num_pages


def _write_converted(path: Path, config, quantize: str) -> Path:
    """A converted checkpoint of random float32 weights, the projections stored quantized
    (values, float32 scales and offsets), as `jaxinfer convert --quantize` lays them out."""
    rng = np.random.default_rng(0)
    arrays = {}
    for key, t in float_tensors(config, "float32", quantize).items():
        if jnp.issubdtype(t.dtype, jnp.integer):
            arrays[key] = rng.integers(-8, 8, t.shape).astype(t.dtype)
        else:
            arrays[key] = (1 + rng.random(t.shape)).astype(t.dtype)
    path.mkdir()
    config = dataclasses.replace(config, quantization=quantize)
    (path / checkpoint.CONFIG_FILE).write_text(config.to_json())
    ocp = checkpoint._ocp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ocp.partial.save(path / checkpoint.WEIGHTS_DIR, arrays)
        ocp.partial.finalize(path / checkpoint.WEIGHTS_DIR)
    return path


def test_quantized_checkpoint_matches_allocation(tmp_path):
    """A converted int4:g32:asym checkpoint is planned from its stored dtypes: int4 values
    (half a byte each), float32 scales and offsets, float32 rest (bfloat16 when the load
    casts them); checked at tp=1 and tp=2 against the load. At tp=4 the row-split o_proj
    (64 inputs, 2 groups of 32 scales) cannot split its groups: both refuse."""
    path = _write_converted(tmp_path / "q", preset_config("tiny"), "int4:g32:asym")
    for spec, dtype in [("tp=1", None), ("tp=2", "bfloat16"), ("tp=2", None)]:
        mesh = _mesh(spec)
        config, tensors = model_tensors(str(path), dtype)
        plan = plan_memory(config, spec, HBM, tensors=tensors)
        assert set(plan.weight_bytes_by_dtype) == {"int4", "float32", dtype or "float32"}
        per_device = _param_bytes(checkpoint.load_model(path, dtype=dtype, mesh=mesh), mesh)
        assert plan.weight_bytes == max(per_device), spec
        assert plan.kv_dtype == (dtype or "float32")
    config, tensors = model_tensors(str(path), None)
    with pytest.raises(JaxinferError, match="groups of scales cannot be split over tp=4"):
        plan_memory(config, "tp=4", HBM, tensors=tensors)
    with pytest.raises(JaxinferError, match="groups of scales cannot be split over tp=4"):
        checkpoint.load_model(path, mesh=_mesh("tp=4"))


def test_plan_arithmetic():
    """Pages, tokens and sequences follow from the bytes; quantizing halves int4 values."""
    config = preset_config("llama3-8b")
    plan = plan_memory(config, "tp=2", 141 * GiB, context=4096)
    assert plan.page_bytes == 2 * 32 * 16 * (8 // 2) * 128 * 2
    qkv = 32 * 4096 * (4096 + 2 * 1024) * 2 // 2  # every layer's q/k/v, half per device
    assert plan.holes_bytes == qkv
    free = plan.usable_bytes - plan.weight_bytes - qkv - plan.reserve_bytes
    assert plan.kv_bytes == free - free % KV_ROUNDING_BYTES
    assert plan.num_pages == plan.kv_bytes // plan.page_bytes - 1
    assert plan.max_seqs == plan.num_pages // 256 and plan.pages_per_seq == 256
    assert plan.kv_tokens == plan.num_pages * 16
    tiny = preset_config("tiny")  # 2 layers of q, k, v, o [64|32, 64], gate, up, down 64x128
    int8 = plan_memory(tiny, "tp=1", GiB, quantization="int8").weight_bytes_by_dtype
    int4 = plan_memory(tiny, "tp=1", GiB, quantization="int4").weight_bytes_by_dtype
    projections = 2 * (64 * (64 + 32 + 32 + 64) + 3 * 64 * 128)
    assert int8["int8"] == projections and int4["int4"] == projections // 2
    scales = 2 * (64 + 32 + 32 + 64 + 128 + 128 + 64) * 4  # float32 per output channel
    assert int8["float32"] == int4["float32"] == scales
    with pytest.raises(JaxinferError, match="weights do not fit"):
        plan_memory(config, "tp=1", 10 * GiB)
    with pytest.raises(JaxinferError, match="does not fit: weights .* GiB"):
        plan_memory(config, "tp=1", 16 * GiB, memory_fraction=1.0)
    with pytest.raises(JaxinferError, match="num_heads=32 is not divisible by tp=3"):
        plan_memory(config, "tp=3", 141 * GiB)


def test_cli(tmp_path):
    runner = CliRunner()
    out = tmp_path / "plan.json"
    result = runner.invoke(cli, ["plan", "--model", "tiny", "--mesh", "tp=2", "--hbm-gb", "1",
                                 "--json", str(out)])
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    expected = plan_memory(preset_config("tiny"), "tp=2", GiB, name="tiny")
    assert saved == json.loads(json.dumps(expected.__dict__))
    assert str(expected.num_pages) in result.output and "tp=2,ep=1,dp=1" in result.output
    assert saved["context"] == 1024 and saved["max_seqs"] == expected.num_pages // 64

    result = runner.invoke(cli, ["plan", "--model", "tiny", "--mesh", "tp=2",
                                 "--hbm-gb", "0.0001"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].lower().startswith("error:"), result.output
    assert "the weights do not fit" in lines[0]

    for bad in (["--mesh", "tp=two"], ["--mesh", "tp=3"], ["--model", "no-such-model"]):
        args = ["plan", "--model", "tiny", "--hbm-gb", "1", *bad]
        result = runner.invoke(cli, args)
        assert result.exit_code == 1, (bad, result.output)
        assert len(result.output.strip().splitlines()) == 1, result.output


def test_suggested_mesh_is_the_fewest_devices_a_replica_fits_on():
    """`plan --gpus N`: replicas of the smallest tp whose plan holds a sequence; a model
    too big for one device gets tp=2; one too big for all of them is a one-line error."""
    config = preset_config("llama3-8b")
    spec, plan = suggest_mesh(config, 4, 80 * GiB, name="llama3-8b")
    assert (spec.tp, spec.dp, spec.ep) == (1, 4, 1) and plan.max_seqs >= 1
    assert plan == plan_memory(config, spec, 80 * GiB, name="llama3-8b")
    # 16 GB of bf16 weights: 20 GiB devices hold a replica only split in two.
    spec, plan = suggest_mesh(config, 4, 20 * GiB, name="llama3-8b")
    assert (spec.tp, spec.dp) == (2, 2)
    with pytest.raises(JaxinferError, match="no layout of 2 device"):
        suggest_mesh(config, 2, 4 * GiB, name="llama3-8b")

    runner = CliRunner()
    result = runner.invoke(cli, ["plan", "--model", "llama3-8b", "--gpus", "4",
                                 "--hbm-gb", "20"])
    assert result.exit_code == 0, result.output
    assert "--mesh tp=2,ep=1,dp=2" in result.output
    result = runner.invoke(cli, ["plan", "--model", "tiny", "--gpus", "2", "--mesh", "tp=2",
                                 "--hbm-gb", "1"])
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1


# -- the LLM's own plan --------------------------------------------------------------------------


class _FakeDevice:
    def __init__(self, bytes_limit):
        self.bytes_limit = bytes_limit

    def memory_stats(self):
        return {"bytes_limit": self.bytes_limit, "bytes_in_use": 0}


def test_device_memory_is_the_utilization_within_jax_pool(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    pool = int(0.75 * 80 * GiB)  # JAX's default pool on an 80 GiB device
    assert plan_module.device_memory_bytes(_FakeDevice(pool), 0.5)[0] == 40 * GiB
    assert plan_module.device_memory_bytes(_FakeDevice(pool), 0.9)[0] == pool  # capped
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # as serve sets it
    assert plan_module.device_memory_bytes(_FakeDevice(int(0.9 * 80 * GiB)), 0.9)[0] == \
        int(0.9 * 80 * GiB)
    assert plan_module.device_memory_bytes(jax.devices("cpu")[0], 0.9) is None


@pytest.mark.parametrize("hbm_gib", [1.25, 3.0])
def test_llm_plans_the_kv_cache_from_the_measured_step(monkeypatch, tmp_path, hbm_gib):
    """With a fake accelerator of hbm_gib, LLM's pool is what is left of the usable memory
    after the weights and the measured reserve (`kv_pages`' arithmetic, done here again),
    the measurement is the largest program's, the allocated pages stay within the budget,
    and a restart reads the measurement instead of compiling the probe again."""
    monkeypatch.setenv("JAXINFER_EXECUTABLE_CACHE", str(tmp_path))
    hbm = int(hbm_gib * GiB)
    monkeypatch.setattr(plan_module, "device_memory_bytes",
                        lambda device, fraction: (int(hbm * fraction), "fake"))
    config = preset_config("tiny")
    seqs, tokens, fraction = 4, 256, 0.8
    model = random_model(config, jnp.float32)
    llm = LLM(model, max_num_seqs=seqs, max_num_batched_tokens=tokens,
              gpu_memory_utilization=fraction)
    kv_plan = llm.kv_plan
    # The step measured is the largest program's: the probe's figure is the warm-up's
    # largest program's own analysis (compiled with the real pool) or more.
    shapes = llm.runner.warmup_shapes(seqs, tokens, 1, llm.max_model_len)
    real = max(llm.runner.steps._lower(s, *llm.runner.example_args(s)).compile()
               .memory_analysis().temp_size_in_bytes for s in shapes)
    assert kv_plan.step_bytes >= real > 0
    leaves = jax.tree.leaves(nnx.state(model))
    weights = sum(x.nbytes for x in leaves)
    reserve = plan_module.WORKSPACE_BYTES + kv_plan.step_bytes + \
        max(x.nbytes for x in leaves) * 11 // 10
    usable = int(hbm * fraction)
    kv = usable - weights - reserve
    kv -= kv % KV_ROUNDING_BYTES
    page_bytes = 2 * config.num_layers * 16 * config.num_kv_heads * config.head_dim * 4
    assert (kv_plan.weight_bytes, kv_plan.reserve_bytes) == (weights, reserve)
    assert llm.runner.num_pages == kv // page_bytes - 1 > 0
    allocated = sum(x.nbytes for x in jax.tree.leaves(llm.runner.kv_cache))  # + scratch page
    assert weights + reserve + allocated <= usable
    # A restart of the same configuration: the same pool, the probe not compiled again.
    records = sorted(tmp_path.glob("*.memory.json"))
    assert records
    stamps = [r.stat().st_mtime_ns for r in records]
    again = LLM(model, max_num_seqs=seqs, max_num_batched_tokens=tokens,
                gpu_memory_utilization=fraction)
    assert again.runner.num_pages == llm.runner.num_pages
    assert [r.stat().st_mtime_ns for r in sorted(tmp_path.glob("*.memory.json"))] == stamps


def test_the_kv_cache_fits_the_largest_free_block_beside_the_reserve(monkeypatch):
    """The holes a load leaves between its arrays hold no KV array: in a fake pool whose
    largest free block is smaller than its free bytes, the KV cache is that block less the
    reserve, and the plan says so."""
    usable = 3 * GiB
    monkeypatch.setattr(plan_module, "device_memory_bytes",
                        lambda device, fraction: (usable, "fake"))
    model = random_model(preset_config("tiny"), jnp.float32)
    whole = LLM(model).kv_plan  # the CPU reports no pool: usable less the weights
    block = (usable - whole.weight_bytes) // 2 + 12345
    monkeypatch.setattr(plan_module, "device_memory_held",
                        lambda device: (whole.weight_bytes + 4096, block))
    llm = LLM(model)
    kv = block - llm.kv_plan.reserve_bytes
    kv -= kv % KV_ROUNDING_BYTES
    assert llm.kv_plan.reserve_bytes == whole.reserve_bytes
    assert llm.runner.num_pages == kv // llm.kv_plan.page_bytes - 1 < whole.num_pages // 2
    assert llm.kv_plan.in_use_bytes == whole.weight_bytes + 4096
    assert "largest free block 1." in llm.kv_plan.format(16)


def test_a_steps_memory_does_not_depend_on_the_pool_size():
    """The probe compiles with a pool of one sequence: its temporaries and outputs are the
    same for a pool of any size, so they are the real pool's program's."""
    from jaxinfer.engine.memory_profile import probe_shapes

    model = random_model(preset_config("tiny-moe"), jnp.bfloat16)
    runners = [ModelRunner(model, pages, 16, 512, max_num_seqs=8) for pages in (32, 3000)]
    shapes = probe_shapes(runners[0], 8, 64, 4)
    assert [(s.kind, s.num_steps) for s in shapes] == [("sample", 1), ("sample", 4),
                                                        ("draw", 1)]
    assert shapes[0].num_tokens == 64 and shapes[2].num_seqs == 8 and shapes[2].filtered
    assert shapes[1].filtered  # the multi-step loop's draw with the filters: the sort's
    for shape in shapes:
        small, large = (r.steps.memory(shape) for r in runners)
        assert small == large and small.temp_bytes > 0, (shape, small, large)


def test_a_model_that_does_not_fit_is_one_line_before_any_compile(monkeypatch):
    """Room for half of one max_model_len sequence: a one-line error with the figures."""
    config = preset_config("tiny")
    monkeypatch.setattr(plan_module, "device_memory_bytes",
                        lambda device, fraction: (64 * GiB, "a large fake device"))
    sizes = [LLM(random_model(config, jnp.float32), max_model_len=n).kv_plan
             for n in (1024, 256)]  # the reserves measured for each
    usable = sizes[0].weight_bytes + max(p.reserve_bytes for p in sizes) + \
        32 * sizes[0].page_bytes
    monkeypatch.setattr(plan_module, "device_memory_bytes",
                        lambda device, fraction: (usable, "0.9 of a fake device"))
    with pytest.raises(JaxinferError) as e:
        LLM(random_model(config, jnp.float32), max_model_len=1024)  # 64 pages of 16 tokens
    message = str(e.value)
    assert "\n" not in message and "does not fit" in message, message
    assert "one sequence of 1024 tokens" in message and "0.9 of a fake device" in message
    LLM(random_model(config, jnp.float32), max_model_len=256)  # 16 pages fit
    # An explicit size is taken as it is.
    llm = LLM(random_model(config, jnp.float32), kv_cache_bytes=1 << 20)
    assert llm.runner.num_pages > 0


@pytest.mark.gpu
def test_planned_cache_stays_within_the_budget_on_the_gpu():
    """Run alone (the peak is the process's): weights, KV pages and a step's peak fit the
    planned share of the device."""
    device = jax.devices()[0]
    llm = LLM(random_model(preset_config("tiny"), jnp.bfloat16), gpu_memory_utilization=0.2,
              max_num_seqs=8, max_num_batched_tokens=512)
    llm.generate([[1, 2, 3] * 100], SamplingParams(max_tokens=32, ignore_eos=True))
    usable, _ = plan_module.device_memory_bytes(device, 0.2)
    assert device.memory_stats()["peak_bytes_in_use"] <= usable


def test_fp8_kv_cache_holds_twice_the_pages_and_reads_back_close(monkeypatch):
    """kv_cache_dtype="fp8": float8_e4m3fn pages, twice the pages of bf16 in one budget, and
    the logits of a prompt read back through them close to the bf16 cache's."""
    monkeypatch.setattr(plan_module, "device_memory_bytes",
                        lambda device, fraction: (int(1.25 * GiB * fraction), "fake"))
    model = random_model(preset_config("tiny"), jnp.bfloat16)
    auto = LLM(model, max_num_seqs=4, max_num_batched_tokens=256)
    fp8 = LLM(model, max_num_seqs=4, max_num_batched_tokens=256, kv_cache_dtype="fp8")
    assert fp8.runner.kv_avals[0][0].dtype == jnp.float8_e4m3fn
    assert auto.runner.kv_avals[0][0].dtype == jnp.bfloat16
    assert fp8.runner.num_pages >= 2 * auto.runner.num_pages > 0
    prompt = np.random.default_rng().integers(2, 200, 40).tolist()
    a, b = (np.asarray(llm.logits([prompt])[0], np.float32) for llm in (auto, fp8))
    assert np.isfinite(b).all() and not np.array_equal(a, b)  # the fp8 pages were read
    assert np.corrcoef(a.ravel(), b.ravel())[0, 1] > 0.99
    with pytest.raises(JaxinferError, match="kv_cache_dtype 'int4'"):
        LLM(model, kv_cache_dtype="int4")
