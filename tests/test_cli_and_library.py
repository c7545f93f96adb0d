"""The CLI (click's CliRunner, and once as real subprocesses) and the library API."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from click.testing import CliRunner

from jaxinfer import LLM, SamplingParams
from jaxinfer.cli.main import cli

from .conftest import VOCAB


@pytest.fixture(scope="module")
def converted(qwen3_converted):
    return qwen3_converted


@pytest.fixture(scope="module")
def llm(converted):
    return LLM(converted)


def test_generate_streams_the_library_text(converted, llm):
    prompt = "The history of printing"
    result = CliRunner().invoke(cli, ["generate", "--model", str(converted), "--prompt", prompt,
                                      "--max-new-tokens", "12"])
    assert result.exit_code == 0, result.output
    expected = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0].text
    assert result.stdout == prompt + expected + "\n"


def test_generate_chat_uses_the_template(converted, llm):
    result = CliRunner().invoke(cli, ["generate", "--model", str(converted), "--prompt", "hello",
                                      "--chat", "--max-new-tokens", "6"])
    assert result.exit_code == 0, result.output
    ids = llm.chat_prompt([{"role": "user", "content": "hello"}])
    assert ids == llm.tokenizer.encode("<user>hello</s><assistant>", add_special_tokens=False)
    expected = llm.generate([ids], SamplingParams(temperature=0, max_tokens=6))[0].text
    assert result.stdout == expected + "\n"


def test_real_subprocess(hf_models, tmp_path):
    env = dict(os.environ, JAXINFER_CACHE=str(tmp_path / "cache"))
    out = tmp_path / "ckpt"
    exe = [sys.executable, "-m", "jaxinfer.cli.main"]
    done = subprocess.run([*exe, "convert", str(hf_models["llama"]), str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    done = subprocess.run([*exe, "generate", "--model", str(out), "--prompt", "Printing",
                           "--max-new-tokens", "4", "--temperature", "0.8", "--seed", "3"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Printing") and len(done.stdout) > len("Printing\n")
    bad = subprocess.run([*exe, "generate", "--model", str(tmp_path / "missing"), "--prompt", "x"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines() == [f"Error: {tmp_path / 'missing'}: no such file or "
                                               "directory"]


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    rng = np.random.default_rng()
    prompts = [rng.integers(2, VOCAB, n).tolist() for n in (5, 23, 11)]
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=12, seed=1234,
                            ignore_eos=True)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert together == alone
    other_seed = llm.generate([prompts[0]], SamplingParams(
        temperature=1.0, max_tokens=12, seed=99, ignore_eos=True))[0].token_ids
    assert other_seed != together[0]


def test_stops_on_stop_token_and_max_tokens(llm):
    prompt = np.random.default_rng().integers(2, VOCAB, 8).tolist()
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10,
                                                 ignore_eos=True))[0]
    assert len(free.token_ids) == 10 and free.finish_reason == "length"
    stop = free.token_ids[4]
    first = free.token_ids.index(stop)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                stop_token_ids=[stop]))[0]
    assert out.token_ids == free.token_ids[:first + 1] and out.finish_reason == "stop"
    assert llm.engine.stats().num_free_pages == llm.runner.num_pages  # every page returned


def test_chunked_prefill_matches_single_step(converted):
    """A prompt longer than the per-step token budget is prefilled in chunks: same result."""
    prompt = np.random.default_rng().integers(2, VOCAB, 70).tolist()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    whole = LLM(converted).generate([prompt], params)[0].token_ids
    chunked = LLM(converted, max_num_batched_tokens=16).generate([prompt], params)[0].token_ids
    assert chunked == whole


class _CompileCounter:
    """Counts XLA compilations (not just traces) while active."""

    def __init__(self):
        self.count = 0

    def __call__(self, event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self)


def test_new_prompt_lengths_do_not_recompile(converted):
    llm = LLM(converted)  # a fresh engine: its first steps compile (or load from disk)
    programs = llm.runner.steps
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    rng = np.random.default_rng()
    llm.generate([rng.integers(2, VOCAB, 20).tolist()], params)
    made = len(programs.shapes())  # prefill bucket T=32, decode bucket T=1
    assert made >= 2
    with _CompileCounter() as compiles:
        for n in (17, 21, 25, 28):  # same token / sequence / page buckets, different lengths
            llm.generate([rng.integers(2, VOCAB, n).tolist()], params)
    assert compiles.count == 0 and len(programs.shapes()) == made
    before = set(programs.shapes())
    llm.generate([rng.integers(2, VOCAB, 40).tolist()], params)  # token bucket T=64
    new = set(programs.shapes()) - before
    narrowest = min(llm.runner.min_page_bucket, llm.runner.max_pages_per_seq)
    assert {(s.num_tokens, s.pages_per_seq) for s in new} == {(64, narrowest)}
