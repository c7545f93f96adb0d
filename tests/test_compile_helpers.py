"""Compile helpers (`jaxinfer.compile_helpers`): the warm-up's programs compiled by other
processes from the weights' descriptions, then loaded by the warm-up. On the CPU the
helpers are forced (JAXINFER_COMPILE_HELPERS); they run where they pay on GPUs."""

import gc
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.compile_helpers import compile_claimed
from jaxinfer.engine.runner import ModelRunner
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
    """The warm-up loads what the helpers compiled and compiles only what is left, and the
    model generates what the same weights generate without helpers (programs made from the
    descriptions run the loaded weights)."""
    config = preset_config("tiny")
    llm = LLM(RandomWeights(config, jnp.float32, seed=9), start_warmup=True, **SETTINGS)
    shapes, steps = llm._helpers.shapes, llm.runner.steps
    assert len(shapes) >= 3
    # As a load slower than the helpers' start would: wait for their first program.
    deadline = time.monotonic() + 120
    while not any(map(steps.on_disk, shapes)) and time.monotonic() < deadline:
        time.sleep(0.1)
    llm.warmup(progress=False)
    assert steps.num_loaded >= 1
    assert steps.num_compiled + steps.num_loaded == len(steps.shapes()) == len(shapes)
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


def test_claimed_programs_are_compiled_once(cache, tmp_path):
    """Two compilers (as two processes would: their own runners, one cache) sharing one
    claims folder compile every program once between them, the most tokens first."""
    config = preset_config("tiny")
    runners = [ModelRunner(RandomWeights(config, jnp.float32).abstract_model(), 256, 8, 256,
                           max_num_seqs=4, weights=None) for _ in range(2)]
    shapes = runners[0].warmup_shapes(4, 16, 1, 256)
    claims = tmp_path / "claims"
    claims.mkdir()
    claimed = [None, None]

    def run(i):
        claimed[i] = compile_claimed(runners[i].steps, shapes, claims, threads=2)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(claimed[0] + claimed[1]) == sorted(shapes) and len(shapes) >= 4
    assert sum(r.steps.num_compiled for r in runners) == len(shapes)
    assert all(map(runners[0].steps.on_disk, shapes))
    # One compiler on one thread takes them the most tokens first (from the disk now).
    (tmp_path / "again").mkdir()
    order = compile_claimed(runners[0].steps, shapes, tmp_path / "again", threads=1)
    assert [s.num_tokens for s in order] == sorted((s.num_tokens for s in shapes),
                                                   reverse=True)
