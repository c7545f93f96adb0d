"""Compile helpers (`jaxinfer.compile_helpers`): the warm-up's programs compiled by other
processes from the weights' descriptions, then loaded by the warm-up. On the CPU the
helpers are forced (JAXINFER_COMPILE_HELPERS); they run where they pay on GPUs."""

import gc

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.loading.presets import RandomWeights, preset_config, random_model

SETTINGS = dict(kv_cache_bytes=1 << 22, max_num_seqs=2, max_num_batched_tokens=4)
PROMPTS = [[5, 6, 7, 8, 9], [11, 3]]


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in llm.generate(PROMPTS, params)]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXINFER_EXECUTABLE_CACHE", str(tmp_path / "executables"))
    monkeypatch.setenv("JAXINFER_COMPILE_HELPERS", "2")
    return tmp_path


def test_helpers_compile_what_the_warmup_loads(cache, monkeypatch):
    """The warm-up compiles only its own share; every other program comes from the helpers'
    files, and the model generates what the same weights generate without helpers
    (programs made from the descriptions run the loaded weights)."""
    config = preset_config("tiny")
    llm = LLM(RandomWeights(config, jnp.float32, seed=9), start_warmup=True, **SETTINGS)
    theirs, own = llm._helpers.shapes, llm._own_share
    assert len(theirs) >= 2 and own and not set(own) & set(theirs)
    llm.warmup(progress=False)
    steps = llm.runner.steps
    assert steps.num_compiled == len(own)
    assert steps.num_loaded == len(theirs) == len(steps.shapes()) - len(own)
    got = _greedy(llm)

    monkeypatch.setenv("JAXINFER_EXECUTABLE_CACHE", "0")
    reference = LLM(random_model(config, jnp.float32, seed=9), **SETTINGS)
    assert reference._helpers is None
    np.testing.assert_array_equal(got, _greedy(reference))


def test_a_failed_helper_leaves_its_programs_to_the_warmup(cache, monkeypatch):
    """Helpers given weights they cannot make exit non-zero; the warm-up then compiles every
    program itself, and progress still reaches the total."""
    config = preset_config("tiny")
    weights = RandomWeights(config, jnp.float32, seed=9)
    monkeypatch.setattr(weights, "describe", lambda: {"converted": str(cache / "missing"),
                                                      "dtype": None})
    llm = LLM(weights, start_warmup=True, **SETTINGS)
    seen = []
    llm.warmup(progress=False, on_progress=lambda done, total: seen.append((done, total)))
    steps = llm.runner.steps
    assert steps.num_loaded == 0 and steps.num_compiled == len(steps.shapes()) >= 3
    assert seen[-1] == (len(steps.shapes()),) * 2
    assert len(_greedy(llm)[0]) == 6


def test_helpers_stop_with_their_llm(cache):
    """An LLM made to warm up that is dropped without warming up leaves no helper running."""
    llm = LLM(RandomWeights(preset_config("tiny"), jnp.float32), start_warmup=True, **SETTINGS)
    processes = list(llm._helpers._processes)
    assert processes
    del llm
    gc.collect()
    assert all(p.poll() is not None for p in processes)
