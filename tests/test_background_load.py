"""A converted checkpoint loads in the background: `ConvertedCheckpoint.abstract_model()`
(what the runner makes its programs from) is the form `load()` builds, array for array; the
tensors read on a thread realize it; an `LLM` makes programs before its weights arrive, and
a step waits for them (or raises the load's error)."""

import threading

import jax
import numpy as np
import pytest
from click.testing import CliRunner
from flax import nnx

from jaxinfer import LLM, SamplingParams
from jaxinfer.cli.main import cli
from jaxinfer.errors import JaxinferError
from jaxinfer.loading.checkpoint import ConvertedCheckpoint, convert, load_model
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
