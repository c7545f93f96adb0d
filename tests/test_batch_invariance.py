"""Batch-invariant mode (`LLM(batch_invariant=True)`, `jaxinfer.ops.registry`): a request's
tokens and logprobs are bitwise the same whatever shares its batch, in bf16 on the CPU,
with prefix-cache hits and preemption in the mix; without the mode they are not."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, JaxinferError, SamplingParams
from jaxinfer.loading.presets import preset_config, random_model
from jaxinfer.ops.linear import LinearCall
from jaxinfer.ops.linear_registry import REGISTRY as LINEAR
from jaxinfer.ops.registry import batch_invariant_mode

PARAMS = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2)


def _prompts(rng) -> list[list[int]]:
    """32 prompts of 3-60 tokens; 8 of them share a 40-token prefix (prefix-cache hits)."""
    shared = rng.integers(2, 500, 40).tolist()
    prompts = [rng.integers(2, 500, int(rng.integers(3, 61))).tolist() for _ in range(24)]
    prompts += [shared + rng.integers(2, 500, int(rng.integers(1, 20))).tolist()
                for _ in range(8)]
    return [prompts[i] for i in rng.permutation(len(prompts))]


def _outputs(outs) -> list:
    return [(o.token_ids, [(x.logprob, x.top) for x in o.logprobs]) for o in outs]


def _together_and_alone(batch_invariant: bool):
    config = dataclasses.replace(preset_config("tiny"), max_position_embeddings=256)
    # 16 pages of 16 tokens: 8 running sequences of up to 80 tokens do not fit: preemption.
    llm = LLM(random_model(config, jnp.bfloat16, seed=5), max_num_seqs=8,
              max_num_batched_tokens=64, kv_cache_bytes=16 * 16 * config.kv_bytes_per_token(2),
              batch_invariant=batch_invariant)
    prompts = _prompts(np.random.default_rng(3))
    together = _outputs(llm.generate(prompts, PARAMS))
    stats = llm.engine.stats()
    alone = [_outputs(llm.generate([p], PARAMS))[0] for p in prompts]
    return together, alone, stats


def test_batch_invariant_requests_match_their_solo_runs():
    together, alone, stats = _together_and_alone(batch_invariant=True)
    assert stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0
    mismatched = [i for i, (a, b) in enumerate(zip(together, alone, strict=True)) if a != b]
    assert not mismatched


def test_without_the_mode_a_batch_changes_the_numbers():
    """The control: the same run in the default mode differs somewhere (else the test above
    could not fail)."""
    together, alone, _ = _together_and_alone(batch_invariant=False)
    assert any(a != b for a, b in zip(together, alone, strict=True))


def test_the_mode_picks_batch_invariant_implementations_only():
    x = jnp.ones((3, 64), jnp.bfloat16)
    call = LinearCall.describe(x, jnp.ones((32, 64), jnp.bfloat16))
    assert LINEAR.pick(call).name == "reference"
    with batch_invariant_mode():
        assert LINEAR.pick(call).name == "fixed_rows"
    assert LINEAR.pick(call).name == "reference"


def test_what_the_mode_does_not_take_is_a_one_line_error():
    model = random_model(preset_config("tiny-moe"), jnp.float32)
    with pytest.raises(JaxinferError, match="batch_invariant: dense models only"):
        LLM(model, batch_invariant=True)
    model = random_model(preset_config("tiny"), jnp.float32)
    with pytest.raises(JaxinferError, match="batch_invariant: decode_steps 4: 1 only"):
        LLM(model, batch_invariant=True, decode_steps=4)
