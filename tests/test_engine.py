"""The engine: the KV page pool (reference counts, prefix caching, LRU eviction), the
scheduler (admission, chunking, preemption), multi-step decode, stops and logprobs, and
dp replicas behind the one-engine interface.

Outputs are checked against the same requests run alone on an engine with a
pool large enough that nothing is cached across requests or preempted: on the tiny
model, and on a runner without a model (`HostRunner`) for the scheduler's own tests.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from jaxinfer import LLM, SamplingParams
from jaxinfer.config import ModelConfig
from jaxinfer.engine.compiled_steps import StepShape
from jaxinfer.engine.engine import (
    RUNNING_GC_THRESHOLDS,
    Engine,
    EngineInterface,
    EngineStats,
    ReplicatedEngine,
)
from jaxinfer.engine.kv_pages import PagePool, page_hash, page_hashes
from jaxinfer.engine.runner import WARMUP_CONTEXT, ModelRunner, StepOutput
from jaxinfer.engine.scheduler import PENDING_TOKEN, SeqChunk
from jaxinfer.loading.presets import preset_config, random_model

from .conftest import VOCAB, gpu_llama_config

PAGE = 16


def test_page_pool_refcounts_prefix_and_lru():
    pool = PagePool(num_pages=4, page_size=2)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free == 1 and pool.allocate(2) is None
    tokens = [5, 6, 7, 8, 9]
    h0 = page_hash(b"", tokens[0:2])
    h1 = page_hash(h0, tokens[2:4])
    pool.register(a[0], h0)
    pool.register(a[1], h1)
    # A sharer finds both full pages (not the partial third) and holds them too.
    hashes = page_hashes(tokens, 2, [])
    pages = pool.lookup(hashes)
    assert pages == a[:2] and hashes == [h0, h1]
    pool.take(pages)
    assert pool.ref[:3] == [2, 2, 1]
    # A different second page only matches the first.
    assert pool.lookup(page_hashes([5, 6, 0, 0], 2, [])) == [a[0]]
    pool.release(a)
    assert pool.ref[:3] == [1, 1, 0] and pool.num_free == 2
    pool.release(pages)
    assert pool.num_free == 4  # all free, pages 0 and 1 still cached
    assert pool.lookup(hashes) == a[:2]
    # Eviction: least recently freed first. Page 3 (never used), then 2, then the tail of
    # the cached prefix (1, released before its head 0).
    assert pool.allocate(3) == [3, 2, 1]
    assert pool.lookup(hashes) == [a[0]]  # page 1's entry is gone, page 0's is not
    with pytest.raises(AssertionError, match="released more often"):
        pool.release([0])


def test_scheduler_imports_no_jax():
    """The scheduler, the request types and the output side run on the host alone: they
    import with jax, jaxlib and flax blocked (the runner, as a check of the block, does not).
    The top-level package's __init__ (it exports LLM) is bypassed; the rest is imported."""
    code = textwrap.dedent(f"""
        import importlib.abc, sys, types

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] in ("jax", "jaxlib", "flax"):
                    raise ImportError(f"{{name}} is blocked")

        sys.meta_path.insert(0, Block())
        package = types.ModuleType("jaxinfer")
        package.__path__ = [{str(Path(jaxinfer.__file__).parent)!r}]
        sys.modules["jaxinfer"] = package
        import jaxinfer.engine.output
        import jaxinfer.engine.request
        import jaxinfer.engine.scheduler
        try:
            import jaxinfer.engine.runner
        except ImportError as e:
            print("runner:", e)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "runner: jax is blocked"


HOST_VOCAB, HOST_EOS = 64, 1


def host_token(seed: int, step: int) -> int:
    """The HostRunner's token number `step` of a sequence: like the sampler's key, a function
    of the seed and the token count only."""
    return (seed * 31 + step * 17 + seed * step * 7) % HOST_VOCAB


class HostRunner:
    """A model runner without a model (what the engine calls of `ModelRunner`): each sequence
    gets its `host_token`s, min(num_steps, remaining) of them. Records whether each chunk of
    each launched batch was a decode (the last token of an up-to-date sequence)."""

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = num_pages, page_size
        self.config = SimpleNamespace(vocab_size=HOST_VOCAB)
        self.batches: list[list[bool]] = []
        self.launched: list[list[SeqChunk]] = []
        self.num_pending = 0  # decodes whose input token was still on the device
        self.num_steps: list[int] = []  # of each batch
        self.steps = SimpleNamespace(num_compiled=0, num_loaded=0, num_on_demand=0)

    def launch(self, chunks: list[SeqChunk], num_steps: int, with_logprobs: bool):
        # A token still on the device (the engine's overlap) is the first of a decode, taken
        # from the same sequence's row of the batch launched just before.
        for c in chunks:
            # Nothing is run for a token past the length limit (planned ahead or not).
            assert c.params is None or c.step < c.params.max_tokens, c
            if PENDING_TOKEN in c.new_tokens or c.prev_row >= 0:
                assert c.new_tokens == [PENDING_TOKEN] and c.prev_row >= 0, c
                before = self.launched[-1][c.prev_row]
                assert (before.seed, before.step) == (c.seed, c.step - 1), (before, c)
                self.num_pending += 1
        self.launched.append(chunks)
        self.batches.append([len(c.new_tokens) == 1 and c.num_cached + 1 == c.num_prompt + c.step
                             for c in chunks])
        self.num_steps.append(num_steps)
        tokens = np.full((len(chunks), num_steps), -1, np.int32)
        for s, c in enumerate(chunks):
            for j in range(min(num_steps, c.remaining)):
                tokens[s, j] = host_token(c.seed, c.step + j)
        return StepOutput(tokens)

    @staticmethod
    def collect(pending: StepOutput) -> StepOutput:
        return pending


def _host_engine(num_pages: int, decode_steps: int = 1, overlap: bool = False) -> Engine:
    return Engine(HostRunner(num_pages, page_size=4), [HOST_EOS], max_model_len=64,
                  max_num_seqs=4, max_num_batched_tokens=12, decode_steps=decode_steps,
                  overlap=overlap)


def _host_workload(seed: int):
    """Eight requests, half of them sharing a 9-token prefix, with explicit seeds (so that
    their outputs do not depend on their ids)."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(2, HOST_VOCAB, 9).tolist()
    prompts = [(shared if i % 2 else []) + rng.integers(2, HOST_VOCAB, rng.integers(3, 16)).tolist()
               for i in range(8)]
    params = [SamplingParams(max_tokens=int(rng.integers(4, 14)), seed=100 + i,
                             ignore_eos=i % 3 == 0) for i in range(8)]
    return prompts, params


def _run_host(engine: EngineInterface, prompts, params, check_step=None) -> list:
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while engine.has_unfinished():
        running = list(engine.running)
        engine.step()
        if check_step:
            check_step(engine)
        # Preemption takes the newest running requests not in the batch: every request
        # newer than a preempted one that still runs is in the batch. So the oldest running
        # request is never preempted.
        scheduled = {id(r) for r, _ in engine.last_batch}
        for preempted in (r for r in running if r in engine.waiting):
            assert all(id(r) in scheduled for r in engine.running if r.id > preempted.id)
            assert preempted.id > min(r.id for r in running)
    return [(r.output_ids, r.finish_reason) for r in requests]


def _solo(prompts, params, decode_steps: int = 1) -> list:
    return [_run_host(_host_engine(64, decode_steps), [p], [sp])[0]
            for p, sp in zip(prompts, params, strict=True)]


@pytest.mark.parametrize("num_pages", [9, 64])
def test_overlapped_steps_give_the_solo_outputs(num_pages):
    """With overlap (the next batch planned and launched while one runs), on the small pool
    of the test below and on a large one: every output (EOS, length limits, prefix hits,
    requests waiting for pages) is its solo output, decodes take their input from the
    previous batch's row of the same sequence, and every page comes back."""
    prompts, params = _host_workload(0)
    want = _solo(prompts, params)
    engine = _host_engine(num_pages, overlap=True)
    assert _run_host(engine, prompts, params) == want
    assert engine.runner.num_pending > 0
    stats = engine.stats()
    assert stats.num_generated_tokens == sum(len(out) for out, _ in want)
    pool = engine.scheduler.pool
    assert pool.num_free == num_pages and not any(pool.ref)
    assert (stats.num_waiting, stats.num_running) == (0, 0)


def test_overlapped_replicas_give_the_solo_outputs():
    """Data parallelism with overlap: each replica plans and launches its next batch while
    its current one runs (`Engine.begin`), before any replica's batch is collected; on a
    small pool (requests wait for pages) every output is its solo output, and every page
    comes back."""
    prompts, params = _host_workload(1)
    want = _solo(prompts, params)
    engines = [_host_engine(12, overlap=True) for _ in range(2)]
    assert _run_host(ReplicatedEngine(engines), prompts, params) == want
    assert all(e.runner.num_pending > 0 for e in engines)  # both planned ahead
    for e in engines:
        assert e.scheduler.pool.num_free == 12 and not any(e.scheduler.pool.ref)


def test_penalized_requests_are_counted_and_keep_steps_from_being_planned_ahead():
    """Requests with penalties need their whole history each step, so while one waits or
    runs no step is planned ahead; the scheduler counts them as they are added, aborted
    (waiting or running) and finished, and planning ahead resumes when none is left."""
    prompts, params = _host_workload(2)
    params[1] = dataclasses.replace(params[1], repetition_penalty=1.3, max_tokens=3)
    engine = _host_engine(64, overlap=True)
    for p, sp in zip(prompts, params, strict=True):
        engine.add_request(p, sp)
    s = engine.scheduler
    assert s.num_penalized == 1
    waiting = engine.add_request(prompts[0], SamplingParams(max_tokens=4, presence_penalty=0.5))
    assert s.num_penalized == 2
    engine.abort(waiting)
    assert s.num_penalized == 1
    running = engine.add_request(prompts[2], SamplingParams(max_tokens=9, frequency_penalty=1))
    seen = []  # (penalized requests before the step, pending decodes planned ahead in it)
    while engine.has_unfinished():
        if running in engine.running and running.num_output > 1:
            engine.abort(running)
        before, pending = s.num_penalized, engine.runner.num_pending
        engine.step()
        seen.append((before, engine.runner.num_pending - pending))
    assert running.finish_reason == "abort" and s.num_penalized == 0
    assert all(planned == 0 for before, planned in seen if before)
    assert any(planned > 0 for before, planned in seen if not before)


@pytest.mark.parametrize("decode_steps", [1, 3])
def test_scheduler_batches_decodes_first_in_budget_and_preempts_the_newest(decode_steps):
    """On a pool far too small (9 pages of 4 tokens for 8 requests of up to 8 pages): every
    batch runs decodes first, then prefill chunks, each oldest first, within the token
    budget; requests are preempted (never the oldest) and recomputed, and every output is
    its solo output; every page comes back."""
    prompts, params = _host_workload(0)
    want = _solo(prompts, params, decode_steps)
    engine = _host_engine(9, decode_steps)

    def check_step(engine):
        decodes = engine.runner.batches[-1]
        batch = engine.last_batch
        assert decodes == sorted(decodes, reverse=True)  # decodes, then prefill chunks
        for group in (True, False):
            ids = [r.id for (r, _), d in zip(batch, decodes, strict=True) if d == group]
            assert ids == sorted(ids)
        assert sum(len(c.new_tokens) for _, c in batch) <= engine.max_num_batched_tokens

    assert _run_host(engine, prompts, params, check_step) == want
    assert any(f == "stop" for _, f in want) and any(f == "length" for _, f in want)
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0
    assert stats.num_steps == len(engine.runner.batches)
    assert stats.num_generated_tokens == sum(len(out) for out, _ in want)
    assert max(engine.runner.num_steps) == decode_steps
    pool = engine.scheduler.pool
    assert pool.num_free == 9 and not any(pool.ref)
    assert (stats.num_waiting, stats.num_running, stats.num_free_pages) == (0, 0, 9)


def test_replicated_engine_is_one_engine_to_its_callers():
    """Two replicas behind ReplicatedEngine: the same outputs as one engine each request
    alone, unique request ids, both replicas used, and the replicas' runners and summed
    stats through the interface."""
    prompts, params = _host_workload(1)
    want = _solo(prompts, params)
    engines = [_host_engine(9), _host_engine(9)]
    replicated = ReplicatedEngine(engines)
    assert isinstance(replicated, EngineInterface)
    assert replicated.runners == [e.runner for e in engines]
    assert replicated.max_num_batched_tokens == 12 and replicated.decode_steps == 1
    requests = [replicated.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    assert sorted(r.id for r in requests) == list(range(8))
    assert len(replicated.waiting) == 8 and all(len(e.waiting) == 4 for e in engines)
    replicated.step()
    assert {id(r) for r, _ in replicated.last_batch} == {
        id(r) for e in engines for r, _ in e.last_batch}
    while replicated.has_unfinished():
        replicated.step()
    assert [(r.output_ids, r.finish_reason) for r in requests] == want
    total = replicated.stats()
    assert total == engines[0].stats() + engines[1].stats()
    assert total.num_steps == sum(len(e.runner.batches) for e in engines)
    assert all(e.stats().num_steps > 0 for e in engines)
    assert total.num_pages == total.num_free_pages == 18
    assert total.num_generated_tokens == sum(len(out) for out, _ in want)
    assert EngineStats() + total == total


@pytest.fixture(scope="module")
def converted(qwen3_converted):
    return qwen3_converted


def _pool_bytes(converted, pages: int) -> int:
    """kv_cache_bytes that give exactly `pages` float32 pages."""
    c = ModelConfig.from_json_file(converted / "model_config.json")
    return pages * 2 * c.num_layers * PAGE * c.num_kv_heads * c.head_dim * 4


def test_default_kv_cache_holds_max_num_seqs_longest_sequences(converted):
    """kv_cache_bytes=None: pages for max_num_seqs sequences of max_model_len, no more."""
    llm = LLM(converted, max_num_seqs=2, max_model_len=100)
    assert llm.runner.num_pages == 2 * -(-100 // PAGE)
    assert llm.max_model_len == 100


def alone(converted, prompts, params):
    """Each request on its own fresh engine (big pool, nothing shared)."""
    out = []
    for p, sp in zip(prompts, params, strict=True):
        llm = LLM(converted, kv_cache_bytes=1 << 22)
        out.append(llm.generate([p], sp)[0].token_ids)
    return out


def test_prefix_cache_hit_same_output_and_skips_prefill(converted):
    rng = np.random.default_rng()
    shared = rng.integers(2, VOCAB, 4 * PAGE + 3).tolist()
    prompts = [shared + rng.integers(2, VOCAB, n).tolist() for n in (5, 9)]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=7,
                             ignore_eos=True)]
    want = alone(converted, prompts, params)

    llm = LLM(converted, kv_cache_bytes=1 << 22)
    eng = llm.engine
    first = llm.generate([prompts[0]], params[0])[0].token_ids
    before = eng.stats()
    assert before.prefix_hit_tokens == 0
    second = llm.generate([prompts[1]], params[1])[0].token_ids
    assert [first, second] == want
    # The 4 full pages of the shared prefix were reused, not prefilled again.
    after = eng.stats()
    assert after.prefix_hit_tokens == 4 * PAGE
    assert after.num_computed_tokens - before.num_computed_tokens == (
        len(prompts[1]) - 4 * PAGE + 9)
    # The same prompt again: every full page before its last token is a hit.
    again = llm.generate([prompts[0]], params[0])[0].token_ids
    assert again == first
    assert eng.stats().prefix_hit_tokens - 4 * PAGE == (len(prompts[0]) - 1) // PAGE * PAGE
    assert eng.stats().num_free_pages == llm.runner.num_pages  # no leaks


def test_concurrent_sharers_and_preemption_give_the_same_outputs(converted):
    """A pool far too small for the load: requests share prefixes, get preempted and
    recomputed, and every one still gives exactly its solo output."""
    rng = np.random.default_rng()
    shared = rng.integers(2, VOCAB, 2 * PAGE).tolist()
    prompts = [(shared if i % 2 else []) + rng.integers(2, VOCAB, rng.integers(3, 30)).tolist()
               for i in range(10)]
    params = [SamplingParams(temperature=0 if i % 3 else 0.8, top_k=20, max_tokens=20 + i,
                             seed=i, ignore_eos=True) for i in range(10)]
    want = alone(converted, prompts, params)

    # 10 pages of 16 tokens: one request needs up to 5, ten of them want ~40.
    llm = LLM(converted, kv_cache_bytes=_pool_bytes(converted, 10), max_num_seqs=8,
              max_num_batched_tokens=48)
    assert llm.runner.num_pages == 10
    # One sharer first, so that the shared pages are cached when the load arrives (a draw
    # whose sharers were all admitted before the first had computed its prefix, or lost
    # it to preemption, had no hits); they are freed last, so evicted last.
    assert llm.generate([prompts[1]], params[1])[0].token_ids == want[1]
    assert llm.engine.stats().prefix_hit_tokens == 0
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0
    pool = llm.engine.scheduler.pool
    assert pool.num_free == 10 and not any(pool.ref)


def _run(converted, prompts, params, **kwargs):
    llm = LLM(converted, kv_cache_bytes=1 << 22, **kwargs)
    return llm, llm.generate(prompts, params)


def test_multi_step_decode_matches_single_steps(converted):
    """N decode steps per host round trip: the same tokens, logprobs, finish reasons and
    text as one step at a time, with EOS ending a sequence early on the device."""
    rng = np.random.default_rng()
    prompts = [rng.integers(2, VOCAB, n).tolist() for n in (5, 17, 30, 9)]
    params = [SamplingParams(temperature=0, max_tokens=23, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=1.0, top_k=30, min_p=0.02, max_tokens=7, seed=3),
              SamplingParams(temperature=0.8, repetition_penalty=1.5, presence_penalty=0.5,
                             frequency_penalty=0.3, max_tokens=19, seed=4),
              SamplingParams(temperature=0, max_tokens=25)]
    _, first = _run(converted, prompts, params)
    # Make the 6th greedy token of the last request an EOS for both engines.
    eos = first[3].token_ids[5]
    one_llm = LLM(converted, kv_cache_bytes=1 << 22)
    one_llm.engine.eos_token_ids = {eos}
    one_llm.runner.eos_token_ids = (eos,)
    one = one_llm.generate(prompts, params)
    multi_llm = LLM(converted, kv_cache_bytes=1 << 22, decode_steps=8)
    multi_llm.engine.eos_token_ids = {eos}
    multi_llm.runner.eos_token_ids = (eos,)  # read when the step is traced
    multi = multi_llm.generate(prompts, params)
    assert one[3].finish_reason == "stop" and len(one[3].token_ids) <= 6
    for a, b in zip(one, multi, strict=True):
        assert a.token_ids == b.token_ids
        assert (a.text, a.finish_reason) == (b.text, b.finish_reason)
    for a, b in zip(one[0].logprobs, multi[0].logprobs, strict=True):
        assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
        np.testing.assert_allclose([a.logprob] + [lp for _, lp in a.top],
                                   [b.logprob] + [lp for _, lp in b.top], atol=1e-4)
    assert multi_llm.engine.num_steps < one_llm.engine.num_steps
    pool = multi_llm.engine.scheduler.pool
    assert pool.num_free == multi_llm.runner.num_pages and not any(pool.ref)


def test_logprobs_are_the_models_log_softmax(converted):
    rng = np.random.default_rng()
    prompt = rng.integers(2, VOCAB, 11).tolist()
    llm = LLM(converted, kv_cache_bytes=1 << 22)
    out = llm.generate([prompt], SamplingParams(temperature=1.0, seed=1, max_tokens=6,
                                                ignore_eos=True, logprobs=5))[0]
    assert len(out.logprobs) == 6
    logits = llm.logits([prompt + out.token_ids[:-1]])[0][len(prompt) - 1:].astype(np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    for j, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[j]
        np.testing.assert_allclose(lp.logprob, logp[j, lp.token_id], atol=1e-4)
        assert [t for t, _ in lp.top] == np.argsort(-logp[j])[:5].tolist()
        np.testing.assert_allclose([v for _, v in lp.top], np.sort(logp[j])[::-1][:5],
                                   atol=1e-4)


def test_penalties_follow_their_definition(converted):
    """Greedy with penalties: each token is the argmax of the model's logits after vLLM's
    penalties over the tokens so far (numpy, from the model's own logits)."""
    rng = np.random.default_rng()
    prompt = rng.integers(2, VOCAB, 9).tolist()
    rep, pres, freq = 1.8, 0.7, 0.4
    llm = LLM(converted, kv_cache_bytes=1 << 22)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                            repetition_penalty=rep, presence_penalty=pres,
                            frequency_penalty=freq)
    out = llm.generate([prompt], params)[0].token_ids
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12,
                                                  ignore_eos=True))[0].token_ids
    assert out != plain
    logits = llm.logits([prompt + out[:-1]])[0][len(prompt) - 1:].astype(np.float64)
    for j, row in enumerate(logits):
        seen = set(prompt + out[:j])
        for t in seen:
            row[t] = row[t] / rep if row[t] > 0 else row[t] * rep
        for t in set(out[:j]):
            row[t] -= freq * out[:j].count(t) + pres
        assert out[j] == int(row.argmax()), j


def test_stop_strings_cut_the_text_and_never_stream_a_partial_stop(converted):
    rng = np.random.default_rng()
    prompt = rng.integers(2, VOCAB, 8).tolist()
    llm = LLM(converted, kv_cache_bytes=1 << 22)
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30,
                                                 ignore_eos=True))[0]
    text = free.text
    assert len(text) > 12
    # A stop string that starts in the middle of the text (first occurrence).
    stop = text[6:10]
    cut = text.index(stop)
    for steps in (1, 4):
        llm = LLM(converted, kv_cache_bytes=1 << 22, decode_steps=steps)
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                stop=["never appears \u2603", stop])
        out = llm.generate([prompt], params)[0]
        assert (out.text, out.finish_reason, out.stop_reason) == (text[:cut], "stop", stop)
        assert out.token_ids == free.token_ids[:len(out.token_ids)]
        deltas = list(llm.stream(prompt, params))
        assert "".join(deltas) == text[:cut]
        assert llm.engine.stats().num_free_pages == llm.runner.num_pages
    # A stop token id ends it too, reported as the stop reason, its token not in the text.
    stop_id = free.token_ids[4]
    first = free.token_ids.index(stop_id)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                stop_token_ids=[stop_id]))[0]
    assert out.token_ids == free.token_ids[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)


def test_warmup_compiles_the_decode_and_prefill_buckets(converted):
    llm = LLM(converted, kv_cache_bytes=1 << 22, max_num_seqs=4, max_num_batched_tokens=64,
              decode_steps=4)
    seconds = llm.warmup(max_len=100, progress=False)
    assert seconds > 0
    steps = llm.runner.steps
    # One page bucket (the narrowest is wider than the 7 pages a sequence can have): token
    # buckets 1..64, the 4-step decodes of 1, 2 and 4 sequences, and the draws of 1, 2 and
    # 4 sequence slots (a one-step batch that samples); the last two with and without the
    # filters.
    assert len(steps.shapes()) == steps.num_compiled + steps.num_loaded == 7 + 2 * 3 + 2 * 3
    assert steps.num_on_demand == 0
    assert not any(llm.engine.scheduler.pool.ref)
    rng = np.random.default_rng()
    prompts = [rng.integers(2, VOCAB, n).tolist() for n in (10, 40, 3, 30)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    # Batched and chunked prefills (83 tokens against 64), prompts beside decodes, then
    # decodes of 4..1 sequences: nothing compiled on demand; nor for requests that sample.
    assert steps.num_on_demand == 0
    llm.generate(prompts, SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True))
    llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10,
                                         ignore_eos=True))
    assert steps.num_on_demand == 0


def test_prepared_inputs_hold_each_chunk_where_its_rows_say():
    """`prepare` (whole-array numpy) against a chunk-by-chunk fill of the same buckets, on
    random prefills, decodes (some taking their token from the device) and penalized rows."""
    rng = np.random.default_rng()
    runner = ModelRunner(random_model(preset_config("tiny"), jnp.float32), num_pages=64,
                         page_size=PAGE, max_model_len=64 * PAGE, max_num_seqs=16)
    penalized = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1,
                               repetition_penalty=1.3, frequency_penalty=0.5, ignore_eos=True)
    chunks = []
    for s in range(int(rng.integers(2, 12))):  # the first a decode, the second a prefill
        n = 1 if s == 0 else int(rng.integers(2, 20)) if s == 1 or rng.random() < 0.5 else 1
        cached = int(rng.integers(0, 40 * PAGE))
        params = rng.choice([None, SamplingParams(temperature=float(rng.random())), penalized])
        history = rng.integers(0, VOCAB, cached + n).tolist()
        chunks.append(SeqChunk(
            new_tokens=rng.integers(0, VOCAB, n).tolist(), num_cached=cached,
            pages=rng.permutation(64)[:-(-(cached + n) // PAGE)].tolist(), params=params,
            seed=int(rng.integers(2**31)), step=int(rng.integers(100)),
            history=history if params is penalized else None, num_prompt=int(rng.integers(n)),
            remaining=int(rng.integers(1, 50)),
            prev_row=int(rng.integers(16)) if n == 1 and rng.random() < 0.5 or s == 0 else -1))
    shape = runner.step_shape(chunks)
    got = runner.prepare(chunks, shape)
    want = runner.empty_inputs(shape)
    t = 0
    for s, c in enumerate(chunks):
        n = len(c.new_tokens)
        want.token_ids[t:t + n] = c.new_tokens
        if c.prev_row >= 0:
            want.token_ids[t], want.prev_rows[t] = 0, c.prev_row
        want.positions[t:t + n] = range(c.num_cached, c.num_cached + n)
        want.md.cu_q_lens[s + 1:] = t + n
        want.md.kv_lens[s] = c.num_cached + n
        want.md.page_indices[s, :len(c.pages)] = c.pages[:shape.pages_per_seq]
        want.logits_indices[s], want.remaining[s] = t + n - 1, c.remaining
        want.stops_on_eos[s] = c.params is None or not c.params.ignore_eos
        if c.history is not None:
            want.history[s, :len(c.history)], want.num_prompt[s] = c.history, c.num_prompt
        p = c.params or SamplingParams(temperature=0)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            getattr(want.sampling, name)[s] = getattr(p, name)
        want.sampling.top_k[s], want.sampling.seeds[s] = p.top_k, c.seed
        want.sampling.steps[s] = c.step
        t += n
    want.md.num_seqs[0] = len(chunks)
    assert shape.history > 0 or not any(c.history for c in chunks)
    flat_want = jax.tree_util.tree_leaves_with_path(want)
    flat_got = jax.tree_util.tree_leaves(got)
    assert len(flat_want) == len(flat_got)
    for (path, a), b in zip(flat_want, flat_got, strict=True):
        np.testing.assert_array_equal(b, a, err_msg=jax.tree_util.keystr(path))
        assert b.dtype == a.dtype, jax.tree_util.keystr(path)
    # The step receives them packed in one int32 vector, and unpacks the same arrays; so
    # does a multi-host follower, on its host, from the leader's broadcast.
    layout = runner.layout(shape)
    for unpacked in (jax.jit(layout.unpack)(layout.pack(got)), layout.unpack(layout.pack(got))):
        for (path, a), b in zip(flat_want, jax.tree_util.tree_leaves(unpacked), strict=True):
            np.testing.assert_array_equal(np.asarray(b), a, err_msg=jax.tree_util.keystr(path))
            assert b.dtype == a.dtype, jax.tree_util.keystr(path)
    # A draw (a batch that samples) receives its sampling inputs packed the same way.
    draw = StepShape("draw", shape.num_seqs, shape.num_seqs, 0, shape.history)
    layout = runner.layout(draw)
    sampled = jax.tree_util.tree_leaves_with_path((want.sampling, want.history,
                                                   want.num_prompt))
    unpacked = jax.jit(layout.unpack)(layout.pack(runner.packed(draw, got)))
    for (path, a), b in zip(sampled, jax.tree_util.tree_leaves(unpacked), strict=True):
        np.testing.assert_array_equal(np.asarray(b), a, err_msg=jax.tree_util.keystr(path))
        assert b.dtype == a.dtype, jax.tree_util.keystr(path)


def test_a_batch_runs_the_program_of_its_token_bucket():
    """A batch pads its tokens to a power of two T, its sequence slots to min(T, the
    bucket of max_num_seqs (or, without one, of its own sequences)), its page table to at
    least WARMUP_CONTEXT tokens: prompts, decodes and mixes of one token bucket share one
    program."""
    runner = ModelRunner(random_model(preset_config("tiny"), jnp.float32), num_pages=8,
                         page_size=PAGE, max_model_len=8 * PAGE)
    chunks = [SeqChunk(new_tokens=[5], num_cached=10 + i, pages=[i]) for i in range(3)]
    decode = runner.prepare(chunks, runner.step_shape(chunks, num_steps=4))
    assert decode.token_ids.shape == (4,) and decode.md.kv_lens.shape == (4,)
    assert list(decode.token_ids) == [5, 5, 5, 0] and list(decode.positions) == [10, 11, 12, 0]
    chunks = [SeqChunk(new_tokens=[7], num_cached=0, pages=[0])]
    single = runner.prepare(chunks, runner.step_shape(chunks))
    assert single.token_ids.shape == (1,)
    chunks = [SeqChunk(new_tokens=[5, 6], num_cached=0, pages=[0]),
              SeqChunk(new_tokens=[7], num_cached=3, pages=[1])]
    prefill = runner.prepare(chunks, runner.step_shape(chunks))
    assert prefill.token_ids.shape == (4,) and prefill.md.kv_lens.shape == (2,)
    assert list(prefill.token_ids) == [5, 6, 7, 0] and list(prefill.positions) == [0, 1, 3, 0]

    runner = ModelRunner(random_model(preset_config("tiny"), jnp.float32), num_pages=64,
                         page_size=PAGE, max_model_len=256 * PAGE, max_num_seqs=5)

    def buckets(chunks):
        shape = runner.step_shape(chunks)
        return shape.num_tokens, shape.num_seqs, shape.pages_per_seq

    table = WARMUP_CONTEXT // PAGE
    assert runner.min_page_bucket == table
    one = [SeqChunk(new_tokens=[5] * 20, num_cached=0, pages=[0, 1])]
    assert buckets(one) == (32, 8, table)
    mixed = one + [SeqChunk(new_tokens=[7], num_cached=30, pages=[2, 3])]
    assert buckets(mixed) == (32, 8, table)
    short = [SeqChunk(new_tokens=[5] * 3, num_cached=0, pages=[0])]
    decode = [SeqChunk(new_tokens=[7], num_cached=30, pages=[2, 3])] * 3
    assert buckets(short) == buckets(decode) == (4, 4, table)
    long = [SeqChunk(new_tokens=[5] * 16, num_cached=150 * PAGE, pages=[])] * 2
    assert buckets(long) == (32, 8, 256)  # past the warm-up's table: its own page bucket


@pytest.mark.parametrize("max_num_seqs,budget,decode_steps", [(5, 100, 4), (64, 3000, 1)])
def test_every_batch_within_the_limits_runs_a_warmed_program(max_num_seqs, budget,
                                                            decode_steps):
    """Random batches the scheduler may form (at most max_num_seqs sequences and `budget`
    tokens, prompts chunked, decodes, contexts up to the warm-up's 2048 tokens; multi-step
    decodes) all map to a shape of `warmup_shapes`, and it holds one shape per token bucket
    (plus the multi-step decodes)."""
    runner = ModelRunner(random_model(preset_config("tiny"), jnp.float32), num_pages=64,
                         page_size=PAGE, max_model_len=256 * PAGE, max_num_seqs=max_num_seqs)
    warm = set(runner.warmup_shapes(max_num_seqs, budget, decode_steps, WARMUP_CONTEXT))
    one_step = [s for s in warm if s.kind == "sample" and s.num_steps == 1]
    tokens = {s.num_tokens for s in one_step}
    assert tokens == {1 << i for i in range((budget - 1).bit_length() + 1)}
    assert len(one_step) == len(tokens)
    # and the draws of each one's sequence slots, for batches that sample: from the whole
    # distribution, and with top-k / top-p / min-p
    assert {s for s in warm if s.kind == "draw"} == {
        StepShape("draw", s.num_seqs, s.num_seqs, 0, filtered=f)
        for s in one_step for f in (False, True)}
    rng = np.random.default_rng()
    for _ in range(300):
        n = int(rng.integers(1, max_num_seqs + 1))
        steps = decode_steps if rng.random() < 0.3 else 1
        chunks = []
        room = budget
        for _ in range(n):
            if room == 0:
                break
            q_len = 1 if steps > 1 or rng.random() < 0.5 else int(rng.integers(1, room + 1))
            q_len = min(q_len, room, WARMUP_CONTEXT - steps)
            room -= q_len
            cached = int(rng.integers(0, WARMUP_CONTEXT - q_len - steps + 1))
            chunks.append(SeqChunk(new_tokens=[5] * q_len, num_cached=cached, pages=[],
                                   remaining=steps))
        shape = runner.step_shape(chunks, steps)
        assert shape in warm, (shape, [len(c.new_tokens) for c in chunks])
        if steps == 1:
            for filtered in (False, True):
                assert StepShape("draw", shape.num_seqs, shape.num_seqs, 0,
                                 filtered=filtered) in warm
        else:  # the loop's draw with the filters too (a sampled row sets one)
            assert dataclasses.replace(shape, filtered=True) in warm


@pytest.mark.gpu
def test_gpu_steps_over_finite_garbage_pages_match_zeroed_pages():
    """On the GPU (bf16, the Mosaic attention kernel, which reads whole pages, and no page
    tail zeroing in the runner's steps): with every cache page holding finite garbage at
    the bf16 extremes (+-1e38) before the run, as pages freed by other sequences hold old
    rows, greedy decodes of one step and of 8 steps a call give the tokens they give over
    zeroed pages."""
    config = gpu_llama_config()
    model = random_model(config, jnp.bfloat16, seed=11)
    rng = np.random.default_rng()
    prompts = [rng.integers(2, 2048, n).tolist() for n in (5, 16, 37, 90)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for steps in (1, 8):
        outs = []
        for garbage in (False, True):
            llm = LLM(model, kv_cache_bytes=64 << 20, decode_steps=steps, page_size=16)
            if garbage:
                llm.runner.kv_cache = [tuple(
                    jnp.asarray(rng.choice([-1e38, 1e38], p.shape), p.dtype) for p in layer)
                    for layer in llm.runner.kv_cache]
                jax.block_until_ready(llm.runner.kv_cache)
            outs.append([o.token_ids for o in llm.generate(prompts, params)])
            assert all(len(t) == 40 for t in outs[-1])
        assert outs[0] == outs[1], steps


def test_generate_runs_with_the_heap_frozen_and_leaves_it_collectable():
    """`LLM.generate` steps with the objects alive before it out of the garbage collector's
    sight (no full collection walks the model and programs mid-run) and the collector at its
    running thresholds; afterwards nothing is frozen and the thresholds are as they were, so
    an engine dropped later is collected."""
    import gc
    import weakref

    llm = LLM(random_model(preset_config("tiny"), jnp.float32), kv_cache_bytes=1 << 20)
    frozen, steps = [], [llm.engine.step]

    def step_seeing_the_heap():  # (frozen objects, objects the collector tracks)
        frozen.append((gc.get_freeze_count(), len(gc.get_objects()), gc.get_threshold()))
        return steps[0]()

    llm.engine.step = step_seeing_the_heap
    before = gc.get_threshold()
    out = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=3))
    assert len(out[0].token_ids) == 3
    assert frozen and all(f > tracked for f, tracked, _ in frozen)
    assert all(t == RUNNING_GC_THRESHOLDS != before for _, _, t in frozen)
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before
    engine = weakref.ref(llm.engine)
    steps.clear()
    del llm, step_seeing_the_heap, out
    gc.collect()
    assert engine() is None


def test_logits_run_in_programs_of_bounded_tokens():
    """`LLM.logits` runs at most `logits_rows` tokens a program: prompts share one while
    they fit, a longer prompt runs in chunks over its pages. The logits equal those of one
    program over every prompt (float32, to rounding); a prompt the free pages cannot hold
    gets a one-line error."""
    import dataclasses

    from jaxinfer.errors import JaxinferError

    config = dataclasses.replace(preset_config("tiny"), max_position_embeddings=512)
    model = random_model(config, jnp.float32, seed=3)
    rng = np.random.default_rng()
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (150, 30, 40, 10)]
    kv_bytes = 64 * 16 * config.kv_bytes_per_token(4)
    whole = LLM(model, kv_cache_bytes=kv_bytes, max_num_batched_tokens=512).logits(prompts)
    llm = LLM(model, kv_cache_bytes=kv_bytes, max_num_seqs=4, max_num_batched_tokens=64)
    assert llm.engine.logits_rows == 64
    calls, run = [], llm.runner.logits

    def counting(chunks):
        calls.append(sum(len(c.new_tokens) for c in chunks))
        return run(chunks)

    llm.runner.logits = counting
    got = llm.logits(prompts)
    assert calls == [64, 64, 22, 30, 50]
    for a, b in zip(got, whole, strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    pool = llm.engine.scheduler.pool
    taken = pool.allocate(pool.num_free - 4)
    try:
        with pytest.raises(JaxinferError, match="too small for a prompt of 150 tokens "
                                                r"\(10 pages of 16 needed, 4 free\)"):
            llm.logits(prompts[:1])
    finally:
        pool.release(taken)
    assert pool.num_free == pool.num_pages
