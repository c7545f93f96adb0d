"""Batch-invariant mode (`LLM(batch_invariant=True)`, `jaxinfer.ops.registry`): a request's
tokens and logprobs are bitwise the same whatever shares its batch, in bf16 on the CPU and
(`pytest -m gpu`) on Hopper, greedy or seeded sampling, with prefix-cache hits and
preemption in the mix; without the mode they are not."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, JaxinferError, SamplingParams
from jaxinfer.loading.presets import preset_config, random_model
from jaxinfer.ops.attention import AttentionCall, AttentionMetadata
from jaxinfer.ops.attention_registry import REGISTRY as ATTENTION
from jaxinfer.ops.grouped_matmul import GroupedMatmulCall
from jaxinfer.ops.grouped_matmul_registry import REGISTRY as GROUPED
from jaxinfer.ops.grouped_matmul_registry import row_group_ids
from jaxinfer.ops.linear import LinearCall
from jaxinfer.ops.linear_registry import REGISTRY as LINEAR
from jaxinfer.ops.registry import batch_invariant_mode

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2)


def _params(i: int) -> SamplingParams:
    """Greedy for even prompts; odd ones sample (top-p), seeded per prompt."""
    if i % 2 == 0:
        return GREEDY
    return SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=i, ignore_eos=True,
                          logprobs=2)


def _prompts(rng) -> list[list[int]]:
    """32 prompts of 3-60 tokens; 8 of them share a 40-token prefix (prefix-cache hits)."""
    shared = rng.integers(2, 500, 40).tolist()
    prompts = [rng.integers(2, 500, int(rng.integers(3, 61))).tolist() for _ in range(24)]
    prompts += [shared + rng.integers(2, 500, int(rng.integers(1, 20))).tolist()
                for _ in range(8)]
    return [prompts[i] for i in rng.permutation(len(prompts))]


def _outputs(outs) -> list:
    return [(o.token_ids, [(x.logprob, x.top) for x in o.logprobs]) for o in outs]


def _together_and_alone(batch_invariant: bool, preset: str = "tiny", **config_changes):
    config = dataclasses.replace(preset_config(preset), max_position_embeddings=256,
                                 **config_changes)
    # 16 pages of 16 tokens: 8 running sequences of up to 80 tokens do not fit: preemption.
    llm = LLM(random_model(config, jnp.bfloat16, seed=5), max_num_seqs=8,
              max_num_batched_tokens=64, kv_cache_bytes=16 * 16 * config.kv_bytes_per_token(2),
              batch_invariant=batch_invariant)
    prompts = _prompts(np.random.default_rng(3))
    params = [_params(i) for i in range(len(prompts))]
    together = _outputs(llm.generate(prompts, params))
    stats = llm.engine.stats()
    alone = [_outputs(llm.generate([p], [sp]))[0] for p, sp in zip(prompts, params, strict=True)]
    return together, alone, stats


def test_batch_invariant_requests_match_their_solo_runs():
    together, alone, stats = _together_and_alone(batch_invariant=True)
    assert stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0
    mismatched = [i for i, (a, b) in enumerate(zip(together, alone, strict=True)) if a != b]
    assert not mismatched


@pytest.mark.gpu
def test_batch_invariant_on_the_gpu():
    """On Hopper, with the Mosaic attention kernel (head_dim 64: its smallest) and XLA's
    GEMMs in blocks of 256 rows."""
    together, alone, stats = _together_and_alone(batch_invariant=True, head_dim=64)
    assert stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0
    mismatched = [i for i, (a, b) in enumerate(zip(together, alone, strict=True)) if a != b]
    assert not mismatched
    pages = jnp.zeros((16, 16, 2, 64), jnp.bfloat16)
    md = AttentionMetadata(cu_q_lens=jnp.zeros(9, jnp.int32), kv_lens=jnp.zeros(8, jnp.int32),
                           page_indices=jnp.zeros((8, 4), jnp.int32),
                           num_seqs=jnp.zeros(1, jnp.int32))
    call = AttentionCall.describe(jnp.zeros((8, 4, 64), jnp.bfloat16),
                                  jnp.zeros((8, 2, 64), jnp.bfloat16), pages, md)
    with batch_invariant_mode():
        assert ATTENTION.pick(call).name == "mosaic_gpu_fixed"


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
    experts = jnp.ones((4, 32, 64), jnp.bfloat16)
    grouped = GroupedMatmulCall.describe(x, experts)
    with batch_invariant_mode():
        assert GROUPED.pick(grouped).name == "rows_fixed_blocks"
    assert GROUPED.pick(grouped).name == "reference"


def test_row_group_ids_follow_the_group_sizes():
    sizes = jnp.array([2, 0, 3, 1], jnp.int32)
    assert row_group_ids(sizes, 8).tolist() == [0, 0, 2, 2, 2, 3, 4, 4]


def test_moe_requests_match_their_solo_runs():
    """An MoE model (Qwen3-MoE's tiny preset): the grouped products in fixed row blocks,
    each row against its own expert, and the combine over k in fixed blocks; the control
    without the mode differs."""
    together, alone, stats = _together_and_alone(True, preset="tiny-moe")
    assert stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0
    assert [i for i, (a, b) in enumerate(zip(together, alone, strict=True)) if a != b] == []
    together, alone, _ = _together_and_alone(False, preset="tiny-moe")
    assert any(a != b for a, b in zip(together, alone, strict=True))


def test_what_the_mode_does_not_take_is_a_one_line_error():
    model = random_model(preset_config("tiny"), jnp.float32)
    with pytest.raises(JaxinferError, match="batch_invariant: decode_steps 4: 1 only"):
        LLM(model, batch_invariant=True, decode_steps=4)
