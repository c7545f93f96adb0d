"""Layers as a scan over stacked weights (`jaxinfer.models.decoder.scan_layers`): the
groups it finds, and a scanned model's tokens, log-probabilities and KV pages against the
same model unrolled, through prefill, chunked prefill and multi-step decode."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.loading.presets import preset_config, random_model
from jaxinfer.models.decoder import ScannedLayers, scan_layers, scan_period

TINY = dataclasses.replace(preset_config("tiny"), num_layers=4)
# gpt-oss's pattern: a window on every other layer, sinks, MoE: scanned in pairs.
ALTERNATING = dataclasses.replace(
    preset_config("tiny-moe"), num_layers=4, sliding_window=8, sliding_layers=(0, 2),
    attention_sinks=True)
# Qwen2-MoE's: dense MLPs in some layers.
MIXED = dataclasses.replace(preset_config("tiny-moe"), num_layers=4, dense_layers=(1, 3))
# No period shorter than the model: left unrolled.
IRREGULAR = dataclasses.replace(preset_config("tiny-moe"), num_layers=3, dense_layers=(2,))


@pytest.mark.parametrize("config, period", [(TINY, 1), (ALTERNATING, 2), (MIXED, 2),
                                            (IRREGULAR, 3)])
def test_scan_period_and_stacking(config, period):
    model = random_model(config, jnp.float32, seed=1)
    layers = list(model.layers)
    assert scan_period(layers) == period
    expected = [np.asarray(lay.attn.o_proj.weight[...]) for lay in layers]
    scanned = scan_layers(model)
    assert scanned == (config.num_layers // period >= 2)
    if not scanned:
        assert model.kv_cache_pools == (config.num_layers, 1)
        return
    assert isinstance(model.layers, ScannedLayers)
    assert model.kv_cache_pools == (period, config.num_layers // period)
    for j in range(period):  # layer g * period + j sits at [g] of position j's stack
        stacked = model.layers.group[j].attn.o_proj.weight
        assert stacked.get_metadata()["axes"][0] is None
        for g in range(config.num_layers // period):
            np.testing.assert_array_equal(np.asarray(stacked[...][g]),
                                          expected[g * period + j])


def _run(config, scan: bool, prompts, params):
    llm = LLM(random_model(config, jnp.float32, seed=2), kv_cache_bytes=64 * 2**10 * 4,
              page_size=4, max_num_seqs=4, max_num_batched_tokens=16, decode_steps=3,
              scan_layers=scan)
    outs = llm.generate(prompts, params)
    return llm, outs


@pytest.mark.parametrize("config", [TINY, ALTERNATING, MIXED], ids=["dense", "alternating",
                                                                    "mixed"])
def test_scanned_model_matches_unrolled(config):
    """Prompts longer than a page and than the token budget (chunked prefill), then
    multi-step decode (its slots zeroed in every layer of each pool): the same tokens, the
    same log-probabilities (float32), and each layer's pages equal to the unrolled layer's."""
    rng = np.random.default_rng()
    prompts = [rng.integers(2, config.vocab_size, n).tolist() for n in (3, 21, 9)]
    params = SamplingParams(max_tokens=11, temperature=0.0, logprobs=2, ignore_eos=True)
    unrolled, a = _run(config, False, prompts, params)
    scanned, b = _run(config, True, prompts, params)
    assert isinstance(scanned.model.layers, ScannedLayers)
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        np.testing.assert_allclose([t.logprob for t in y.logprobs],
                                   [t.logprob for t in x.logprobs], rtol=1e-4, atol=1e-4)
    period, groups = scanned.model.kv_cache_pools
    layer_pages = unrolled.runner.kv_cache[0][0].shape[0]
    for layer, pair in enumerate(unrolled.runner.kv_cache):
        g, j = divmod(layer, period)
        for want, pool in zip(pair, scanned.runner.kv_cache[j], strict=True):
            got = jax.device_get(pool)[g * layer_pages:(g + 1) * layer_pages]
            # The scratch page (last) takes padding tokens' rows in either order; skip it.
            np.testing.assert_allclose(got[:-1], jax.device_get(want)[:-1], rtol=1e-4,
                                       atol=1e-5)
