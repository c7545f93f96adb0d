"""The engine's KV page pool: reference counts, prefix caching, LRU eviction, preemption.

Outputs are checked against the same requests run alone on an engine with a
pool large enough that nothing is cached across requests or preempted.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import ModelConfig
from jaxinfer.kv_pages import PagePool, page_hash, page_hashes

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
