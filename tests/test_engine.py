"""The engine's KV page pool: reference counts, prefix caching, LRU eviction, preemption.

Outputs are checked against the same requests run alone on an engine with a
pool large enough that nothing is cached across requests or preempted.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import ModelConfig
from jaxinfer.engine.kv_pages import PagePool, page_hash, page_hashes

from .conftest import VOCAB

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


@pytest.fixture(scope="module")
def converted(qwen3_converted):
    return qwen3_converted


def _pool_bytes(converted, pages: int) -> int:
    """kv_cache_bytes that give exactly `pages` float32 pages."""
    c = ModelConfig.from_json_file(converted / "model_config.json")
    return pages * 2 * c.num_layers * PAGE * c.num_kv_heads * c.head_dim * 4


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
    computed, hits = eng.num_computed_tokens, eng.prefix_hit_tokens
    assert hits == 0
    second = llm.generate([prompts[1]], params[1])[0].token_ids
    assert [first, second] == want
    # The 4 full pages of the shared prefix were reused, not prefilled again.
    assert eng.prefix_hit_tokens - hits == 4 * PAGE
    assert eng.num_computed_tokens - computed == len(prompts[1]) - 4 * PAGE + 9
    # The same prompt again: every full page before its last token is a hit.
    again = llm.generate([prompts[0]], params[0])[0].token_ids
    assert again == first
    assert eng.prefix_hit_tokens - hits - 4 * PAGE == (len(prompts[0]) - 1) // PAGE * PAGE
    assert eng.allocator.num_free == llm.runner.num_pages  # no leaks


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
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert llm.engine.num_preemptions > 0
    assert llm.engine.prefix_hit_tokens > 0
    assert llm.engine.allocator.num_free == 10 and not any(llm.engine.allocator.ref)


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
    eng = multi_llm.engine
    assert eng.allocator.num_free == multi_llm.runner.num_pages and not any(eng.allocator.ref)


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
        assert llm.engine.allocator.num_free == llm.runner.num_pages
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
    compiled = llm.runner._sample_step._cache_size()
    # seq buckets 1, 2, 4 x page buckets 4, 7 (100 tokens = 7 pages) + token buckets 16..64
    assert compiled == 3 * 2 + 3
    assert not any(llm.engine.allocator.ref)
    rng = np.random.default_rng()
    prompts = [rng.integers(2, VOCAB, n).tolist() for n in (10, 40, 3)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    # Prefills of 16..64 tokens, then decodes of 3, 2 and 1 sequences: nothing new compiled
    # except the mixed prefill+decode batches the scheduler formed.
    assert llm.runner._sample_step._cache_size() <= compiled + 2


def test_decode_batches_pad_tokens_to_the_sequence_bucket():
    """A decode batch (one token per sequence) pads to T = S tokens (one all-reduce row per
    sequence under tensor parallelism); anything else pads to >= 16 tokens."""
    import jax.numpy as jnp

    from jaxinfer.engine.runner import ModelRunner, SeqChunk
    from jaxinfer.loading.presets import preset_config, random_model

    runner = ModelRunner(random_model(preset_config("tiny"), jnp.float32), num_pages=8,
                         page_size=PAGE, max_model_len=8 * PAGE)
    decode = runner.prepare([SeqChunk(new_tokens=[5], num_cached=10 + i, pages=[i])
                             for i in range(3)], num_steps=4)
    assert decode.token_ids.shape == (4,) and decode.md.kv_lens.shape == (4,)
    assert list(decode.token_ids) == [5, 5, 5, 0] and list(decode.positions) == [10, 11, 12, 0]
    single = runner.prepare([SeqChunk(new_tokens=[7], num_cached=0, pages=[0])])
    assert single.token_ids.shape == (1,)
    prefill = runner.prepare([SeqChunk(new_tokens=[5, 6], num_cached=0, pages=[0]),
                              SeqChunk(new_tokens=[7], num_cached=3, pages=[1])])
    assert prefill.token_ids.shape == (16,) and prefill.md.kv_lens.shape == (2,)


@pytest.mark.gpu
def test_gpu_multi_step_decode_over_poisoned_pages_matches_single_steps():
    """On the GPU (bf16, the Mosaic attention kernel, which reads whole pages): with every
    cache page NaN before the run, an 8-step on-device decode (page tails zeroed once per
    loop, `zero_decode_slots`) gives the single-step engine's greedy tokens (tails zeroed by
    every step's write), and both are NaN-free."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.loading.presets import random_model

    config = ModelConfig(family="llama", vocab_size=2048, hidden_size=1024,
                         intermediate_size=2048, num_layers=2, num_heads=16, num_kv_heads=4,
                         head_dim=64, max_position_embeddings=2048, eos_token_ids=(1,))
    model = random_model(config, jnp.bfloat16, seed=11)
    rng = np.random.default_rng()
    prompts = [rng.integers(2, 2048, n).tolist() for n in (5, 16, 37, 90)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = []
    for steps in (1, 8):
        llm = LLM(model, kv_cache_bytes=64 << 20, decode_steps=steps, page_size=16)
        llm.runner.kv_cache = [tuple(jnp.full_like(p, jnp.nan) for p in layer)
                               for layer in llm.runner.kv_cache]
        jax.block_until_ready(llm.runner.kv_cache)
        outs.append([o.token_ids for o in llm.generate(prompts, params)])
        assert all(len(t) == 40 for t in outs[-1])
    assert outs[0] == outs[1]
