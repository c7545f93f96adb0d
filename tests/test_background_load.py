"""A converted checkpoint loads in the background: `ConvertedCheckpoint.abstract_model()`
(what the runner makes its programs from) is the form `load()` builds, array for array; the
tensors read on a thread realize it; an `LLM` makes programs before its weights arrive, and
a step waits for them (or raises the load's error). On the CPU, `HostArrayReader` reads the
arrays Orbax would, into buffers the device takes without a copy."""

import threading

import jax
import numpy as np
import pytest
from click.testing import CliRunner
from flax import nnx

from jaxinfer import LLM, SamplingParams
from jaxinfer.cli.main import cli
from jaxinfer.errors import JaxinferError
from jaxinfer.loading import checkpoint as checkpoint_module
from jaxinfer.loading.checkpoint import (
    CPU_ZERO_COPY_ALIGNMENT,
    ConvertedCheckpoint,
    HostArrayReader,
    convert,
    load_model,
)
from jaxinfer.sharding import MeshSpec


def _described(model):
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    return graphdef, treedef, [(x.shape, x.dtype, x.sharding) for x in leaves], leaves


@pytest.mark.parametrize("family,quantize,mesh", [
    ("llama3-tied", None, None),
    ("qwen2", "int8", None),  # biases joined, quantized q/k/v unfolded
    ("qwen3_moe", None, "tp=2"),  # joined per shard, expert stacks, a folded router
    ("mistral", "int4:g32", "tp=2"),  # KV heads repeated for tp, grouped scales split
])
def test_abstract_model_is_the_loaded_form(hf_models, tmp_path, family, quantize, mesh,
                                           monkeypatch):
    out = convert(hf_models[family], tmp_path / "ckpt", "float32", quantize=quantize,
                  progress=False)
    mesh = MeshSpec.parse(mesh).meshes()[0]
    # HF initialises norms to ones, which folding would leave unseen: scale them randomly
    # (the same for both loads).
    factors, read = {}, ConvertedCheckpoint._read

    def read_with_random_norms(self):
        params = read(self)
        for key, a in params.items():
            if key.endswith("norm.scale"):
                if key not in factors:
                    factors[key] = np.random.default_rng().uniform(0.5, 1.5, a.shape)
                params[key] = jax.device_put(a * factors[key].astype(a.dtype), a.sharding)
        return params

    monkeypatch.setattr(ConvertedCheckpoint, "_read", read_with_random_norms)
    checkpoint = ConvertedCheckpoint(out, None, mesh)
    future = checkpoint.load_in_background()
    abstract = _described(checkpoint.abstract_model())
    realized = _described(future.result())
    built = _described(ConvertedCheckpoint(out, None, mesh).load())  # `load_model`'s way
    for got in (realized, built):
        assert got[0] == abstract[0] and got[1] == abstract[1]
        assert got[2] == abstract[2]
    assert all(isinstance(x, jax.Array) for x in realized[3])
    for a, b in zip(realized[3], built[3], strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_llm_makes_programs_while_the_weights_load(qwen3_converted, monkeypatch):
    release = threading.Event()
    read = ConvertedCheckpoint._read

    def slow_read(self):
        assert release.wait(120)
        return read(self)

    monkeypatch.setattr(ConvertedCheckpoint, "_read", slow_read)
    llm = LLM(qwen3_converted, max_num_seqs=2, max_model_len=64)  # returns, weights unread
    runner = llm.runner
    shapes = runner.warmup_shapes(2, 8, 1, 64)[:2]
    runner.steps.compile_many(shapes)  # programs from the descriptions alone
    assert all(runner.steps.has(s) for s in shapes)
    assert not llm._weights.done()
    release.set()
    params = SamplingParams(max_tokens=6, temperature=0.0)
    got = [o.token_ids for o in llm.generate(["the sea", "a printing press"], params)]
    eager = LLM(load_model(qwen3_converted), max_num_seqs=2, max_model_len=64)
    eager.tokenizer = llm.tokenizer
    want = [o.token_ids for o in eager.generate(["the sea", "a printing press"], params)]
    assert got == want


def test_a_failed_background_load_raises_at_the_first_step(qwen3_converted, monkeypatch):
    def broken_read(self):
        raise JaxinferError(f"{self.weights_dir}: cannot read checkpoint (damaged)")

    monkeypatch.setattr(ConvertedCheckpoint, "_read", broken_read)
    llm = LLM(qwen3_converted, max_num_seqs=1, max_model_len=64)
    with pytest.raises(JaxinferError, match="cannot read checkpoint"):
        llm.generate("hi", SamplingParams(max_tokens=2))
    with pytest.raises(JaxinferError, match="cannot read checkpoint"):
        llm.warmup(progress=False, max_len=64)  # ready means loaded
    result = CliRunner().invoke(cli, ["generate", "--model", str(qwen3_converted),
                                      "--prompt", "hi", "--max-new-tokens", "2"])
    assert result.exit_code == 1
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert errors == [f"Error: {qwen3_converted / 'weights'}: cannot read checkpoint "
                      "(damaged)"], result.output


def _orbax_arrays(weights_dir):
    from orbax.checkpoint.experimental import v1 as ocp
    return ocp.load(weights_dir.absolute())


@pytest.mark.parametrize("quantize,dtype", [
    (None, None),  # floats as stored
    (None, jax.numpy.bfloat16),  # cast while reading
    ("int4:g32", None),  # zstd-compressed sub-byte values, float32 scales
])
def test_host_reader_reads_what_orbax_reads(hf_models, tmp_path, monkeypatch, quantize,
                                            dtype):
    out = convert(hf_models["qwen2"], tmp_path / "ckpt", "float32", quantize=quantize,
                  progress=False)
    reader = HostArrayReader.open(out / "weights")
    assert reader is not None
    want = {k: jax.ShapeDtypeStruct(s.shape, dtype or s.dtype) for k, s in reader.stored.items()}
    empty = checkpoint_module._aligned_empty

    def poisoned(shape, dtype):  # every element must be written by the read
        a = empty(shape, dtype)
        a.view(np.uint8)[...] = 0xFF  # NaN in floats, -1 in ints
        return a

    monkeypatch.setattr(checkpoint_module, "_aligned_empty", poisoned)
    got = reader.read(want)
    orbax = _orbax_arrays(out / "weights")
    assert sorted(got) == sorted(orbax)
    for key, a in got.items():
        assert a.dtype == want[key].dtype and a.shape == orbax[key].shape
        np.testing.assert_array_equal(a, orbax[key].astype(a.dtype))
        assert a.ctypes.data % CPU_ZERO_COPY_ALIGNMENT == 0
    # Aligned, so the CPU device takes the buffer as it is (the point of the reader).
    a = got["embed.embedding"]
    assert jax.device_put(a).unsafe_buffer_pointer() == a.ctypes.data


def test_host_reader_leaves_other_layouts_to_orbax(qwen3_converted, tmp_path, monkeypatch):
    import shutil

    copy = shutil.copytree(qwen3_converted, tmp_path / "ckpt")
    metadata = copy / "weights" / "state" / "_METADATA"
    metadata.write_text(metadata.read_text().replace('"use_zarr3": true', '"use_zarr3": false'))
    assert HostArrayReader.open(copy / "weights") is None  # zarr2: not its layout
    mesh = MeshSpec.parse(None).meshes()[0]
    want = _described(ConvertedCheckpoint(qwen3_converted, None, mesh).load())[3]
    monkeypatch.setattr(HostArrayReader, "open", lambda weights_dir: None)
    checkpoint = ConvertedCheckpoint(qwen3_converted, None, mesh)
    assert checkpoint._reader is None  # Orbax reads it, and it loads all the same
    got = _described(checkpoint.load())[3]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_host_reader_reports_a_damaged_file(qwen3_converted, tmp_path):
    import shutil

    copy = shutil.copytree(qwen3_converted, tmp_path / "ckpt")
    data = max((p for p in (copy / "weights" / "state").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(JaxinferError, match="cannot read checkpoint"):
        load_model(copy)
