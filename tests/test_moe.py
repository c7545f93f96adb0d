"""MoE specifics beyond the parity tests (test_parity.py runs every MoE family against HF):
gpt-oss's MXFP4 expert weights loaded from safetensors, converted MoE checkpoints (float,
MXFP4 and `--quantize`d experts), and the router's two weightings.

MXFP4 checkpoints are written here from a tiny random gpt-oss by this file's own packer
(OCP microscaling: 32 e2m1 values per e8m0 power-of-two scale); HF transformers
dequantizes them on the CPU by its own code, so the two sides share nothing but the file.
"""

from __future__ import annotations

import itertools
import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.numpy import load_file, save_file

import jaxinfer.models.moe as moe
from jaxinfer import LLM, SamplingParams
from jaxinfer.cli.main import cli
from jaxinfer.loading.presets import preset_config
from jaxinfer.models.moe import route
from jaxinfer.mosaic.grouped_matmul import upcasts_in_registers
from jaxinfer.ops import expert_routing
from jaxinfer.ops import grouped_matmul_registry as gmr
from jaxinfer.ops.grouped_matmul import GroupedMatmulCall
from jaxinfer.ops.quant import quantize

from .conftest import VOCAB


def _pack_mxfp4(w_out_in: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """W [E, N, K] float -> (blocks [E, N, K/32, 16] uint8, scales [E, N, K/32] uint8)."""
    e, n, k = w_out_in.shape
    groups = w_out_in.reshape(e, n, k // 32, 32).astype(np.float64)
    absmax = np.abs(groups).max(-1)
    exp = np.where(absmax > 0, np.ceil(np.log2(np.maximum(absmax, 1e-30) / 6.0)), 0)
    codes = (groups / 2.0 ** exp[..., None]).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    codes = codes.reshape(e, n, k // 32, 16, 2)
    blocks = (codes[..., 0] & 0x0F) | (codes[..., 1] << 4)
    return blocks.astype(np.uint8), (exp + 127).astype(np.uint8)


def _mxfp4_gpt_oss(src, dst):
    """A copy of the HF gpt-oss checkpoint `src` with its expert weights in MXFP4."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = np.swapaxes(tensors.pop(name).astype(np.float32), 1, 2)  # [E, in, out] -> out-major
        tensors[name + "_blocks"], tensors[name + "_scales"] = _pack_mxfp4(w)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["router", "attn", "lm_head",
                                                                "embed_tokens"]}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _hf_logits(path, prompt):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().numpy()


def test_gpt_oss_mxfp4_experts_match_hf_and_survive_conversion(hf_models, tmp_path):
    src = _mxfp4_gpt_oss(hf_models["gpt_oss"], tmp_path / "mxfp4")
    prompt = np.random.default_rng().integers(2, VOCAB, 40).tolist()  # > the 16-token window
    ref = _hf_logits(src, prompt)

    direct = LLM(src, dtype="float32")
    experts = direct.model.layers[0].mlp.experts.gate_up_proj
    assert experts.quantized and experts.quantized_weight().kind == "fp4"
    ours = direct.logits([prompt])[0]
    assert np.abs(ours - ref).max() <= 1e-4

    out = tmp_path / "ckpt"
    result = CliRunner().invoke(cli, ["convert", str(src), str(out), "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "model_config.json").read_text())["quantization"] == "mxfp4"
    np.testing.assert_array_equal(LLM(out).logits([prompt])[0], ours)


# Logit shifts seen on these random models: int8 ~0.005, mxfp4 0.05-0.17, nvfp4 0.09-0.12
# (e2m1 keeps one mantissa bit: weights move by up to 25%). The exact MXFP4 arithmetic is
# checked against HF above; this test covers `convert --quantize` of expert stacks end to end.
@pytest.mark.parametrize("fmt, tolerance", [("int8", 0.03), ("mxfp4", 0.5), ("nvfp4", 0.5)])
def test_quantized_experts_stay_close_to_float(hf_models, tmp_path, fmt, tolerance):
    """`convert --quantize` quantizes the experts too; logits move by quantization noise only,
    and the greedy path of a batch equals each prompt run alone."""
    src = hf_models["qwen3_moe"]
    out = tmp_path / "q"
    result = CliRunner().invoke(cli, ["convert", str(src), str(out), "--dtype", "float32",
                                      "--quantize", fmt])
    assert result.exit_code == 0, result.output
    llm, ref = LLM(out), LLM(src, dtype="float32")
    experts = llm.model.layers[0].mlp.experts.down_proj
    assert experts.quantized
    prompt = np.random.default_rng().integers(2, VOCAB, 24).tolist()
    diff = np.abs(llm.logits([prompt])[0] - ref.logits([prompt])[0]).max()
    assert 0 < diff <= tolerance
    prompts = [prompt, prompt[:7]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    assert together == [llm.generate([p], params)[0].token_ids for p in prompts]


@pytest.mark.parametrize("shape,k", [((5, 8), 3), ((16, 128), 8)])
def test_router_weightings(shape, k):
    """The router's weights and experts against a float64 oracle, on random logits and on
    small integers (many ties: the lower expert first), each also with a per-token logit
    scale (a router holding its norm's scale). (Each way to the top k is checked against
    numpy in test_expert_routing.py.)"""
    key = jax.random.key(np.random.randint(1 << 30))
    tied = jax.random.randint(key, shape, -2, 3).astype(jnp.float32)
    scale = jnp.exp(jax.random.normal(jax.random.fold_in(key, 1), (shape[0], 1)))
    for logits, logit_scale in itertools.product((jax.random.normal(key, shape), tied),
                                                 (None, scale)):
        x = np.asarray(logits, np.float64)
        if logit_scale is not None:
            x = x * np.asarray(logit_scale, np.float64)
        top = np.argsort(-x, axis=1, kind="stable")[:, :k]
        full = np.exp(x - x.max(1, keepdims=True))
        full /= full.sum(1, keepdims=True)
        chosen = np.take_along_axis(full, top, 1)
        for norm, want in [(True, chosen / chosen.sum(1, keepdims=True)), (False, chosen)]:
            weights, experts = route(logits, k, norm, logit_scale)
            np.testing.assert_array_equal(np.asarray(experts), top)
            np.testing.assert_allclose(np.asarray(weights), want, rtol=1e-5)
    assert route(jnp.asarray(logits, jnp.bfloat16).astype(jnp.float32), 3, True)[0].dtype \
        == jnp.float32


def test_padding_tokens_route_nowhere(monkeypatch):
    """A padded batch's dead tokens hit no expert (a batch-1 decode reads only k experts);
    live tokens' outputs do not depend on the padding."""
    from flax import nnx

    config = preset_config("tiny-moe")
    layer = moe.MoE(config, dtype=jnp.float32, rngs=nnx.Rngs(np.random.randint(1 << 30)))
    seen = []
    real = moe.grouped_matmul
    monkeypatch.setattr(moe, "grouped_matmul",
                        lambda x, w, sizes, **kw: seen.append(int(sizes.sum()))
                        or real(x, w, sizes, **kw))
    x = jax.random.normal(jax.random.key(np.random.randint(1 << 30)), (8, config.hidden_size))
    live = jnp.arange(8) < 3
    padded = layer(x, live)
    assert seen == [3 * config.num_experts_per_tok] * 2  # gate_up and down
    np.testing.assert_allclose(np.asarray(padded[:3]), np.asarray(layer(x[:3])), rtol=1e-6,
                               atol=1e-6)


def _block_through(monkeypatch, layer, args, implementation, platform, calls, key,
                   picked=None):
    """layer(*args) as float32 numpy, on `platform`, with every grouped matmul of the MoE
    block forced to `implementation` (None: the registry's pick); appends each call's
    keyword `key` to calls, and the implementation that ran to `picked`."""

    def call(x, w, sizes, **kw):
        calls.append(kw[key])
        if picked is not None:
            picked.append(gmr.REGISTRY.pick(GroupedMatmulCall.describe(x, w, **kw),
                                            implementation).name)
        return gmr.grouped_matmul(x, w, sizes, implementation=implementation, **kw)

    monkeypatch.setattr(moe, "grouped_matmul", call)
    with jax.default_device(jax.devices(platform)[0]):
        return np.asarray(layer(*args).astype(jnp.float32))


@pytest.mark.parametrize("implementation,platform", [
    ("mosaic_gpu", "cpu"), pytest.param(None, "gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("live", [True, False])
def test_one_token_rows_in_router_order(monkeypatch, live, implementation, platform):
    """At one token the MoE block skips the pair sort: its k rows stay in the router's
    order, each a group of its own (`rows_sorted=False`). Through the Mosaic grouped matmul
    (interpret mode on the CPU), or on the GPU through the registry's pick (which reduces
    each row against its expert's weights, `row_reduce`), the block matches the same block
    through jax's `ragged_dot` (the reference, which gets the rows sorted); a padding
    token's output is zero."""
    import dataclasses

    from flax import nnx

    config = dataclasses.replace(preset_config("tiny-moe"), moe_intermediate_size=64)
    layer = moe.MoE(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(np.random.randint(1 << 30)))
    x = jax.random.normal(jax.random.key(np.random.randint(1 << 30)),
                          (1, config.hidden_size)).astype(jnp.bfloat16)
    calls, picked = [], []
    want, got = (_block_through(monkeypatch, layer, (x, jnp.array([live])), impl, platform,
                                calls, "rows_sorted", picked)
                 for impl in ("reference", implementation))
    assert calls == [False] * 4
    assert picked == ["reference"] * 2 + [implementation or "row_reduce"] * 2
    assert np.isfinite(got).all()
    if not live:
        assert (got == 0).all() and (want == 0).all()
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def _force_aligned_rows(monkeypatch):
    """Every MoE block lays its pairs out in the aligned layout, whatever their number (and
    an LLM's step programs are traced anew: one loaded from the executable cache, compiled
    without the patch, would not be)."""
    monkeypatch.setenv("JAXINFER_EXECUTABLE_CACHE", "0")
    monkeypatch.setattr(moe, "expert_rows", lambda *args, **kw: expert_routing.expert_rows(
        *args, implementation="aligned", **kw))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_prefill_aligned_rows_match_hf(hf_models, monkeypatch, family):
    """The layout of large prefill steps (each expert's group padded to a multiple of 8
    rows: `expert_rows`' "aligned", where `aligns_groups`), forced here at 40 tokens:
    float32 logits match HF's, and the grouped matmuls are told that the groups are aligned.
    (gpt-oss: expert biases, gathered for the pad rows too.)"""
    from transformers import AutoModelForCausalLM

    _force_aligned_rows(monkeypatch)
    seen, real = [], moe.grouped_matmul
    monkeypatch.setattr(moe, "grouped_matmul", lambda x, w, sizes, **kw: seen.append(
        (kw["groups_aligned"], x.shape[0])) or real(x, w, sizes, **kw))
    prompt = np.random.default_rng().integers(2, VOCAB, 40).tolist()
    hf = AutoModelForCausalLM.from_pretrained(hf_models[family], dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].numpy()
    ours = LLM(hf_models[family], dtype="float32").logits([prompt])[0]
    assert np.abs(ours - ref).max() <= 1e-4
    assert seen and all(aligned and rows % 8 == 0 and rows > 40 for aligned, rows in seen)


@pytest.mark.parametrize("implementation,platform", [
    ("mosaic_gpu", "cpu"), pytest.param(None, "gpu", marks=pytest.mark.gpu)])
def test_prefill_aligned_rows_through_the_kernel(monkeypatch, implementation, platform):
    """The aligned prefill layout through the Mosaic grouped matmul (interpret mode on the
    CPU; the registry's pick on the GPU), where it stores whole 8-row tiles: the block
    matches the same block through jax's `ragged_dot` (the reference)."""
    import dataclasses

    from flax import nnx

    _force_aligned_rows(monkeypatch)
    config = dataclasses.replace(preset_config("tiny-moe"), hidden_size=128,
                                 moe_intermediate_size=128)
    layer = moe.MoE(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(np.random.randint(1 << 30)))
    x = jax.random.normal(jax.random.key(np.random.randint(1 << 30)),
                          (40, config.hidden_size)).astype(jnp.bfloat16)
    calls = []
    want, got = (_block_through(monkeypatch, layer, (x,), impl, platform, calls,
                                "groups_aligned")
                 for impl in ("reference", implementation))
    assert calls == [True] * 4
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


@pytest.mark.parametrize("implementation,platform", [
    ("mosaic_gpu", "cpu"), pytest.param(None, "gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("tokens,fmt", [(1, "int8"), (5, "int4:g64")])
def test_quantized_experts_through_the_kernel(monkeypatch, tokens, fmt, implementation,
                                              platform):
    """int8 / int4 expert stacks through the Mosaic grouped matmul, which upcasts them in
    registers (interpret mode on the CPU; the registry's pick on the GPU), at one token
    (the router's order, silu(gate) * up in the epilogue) and at five (sorted rows): the
    block matches the same block through jax's `ragged_dot` on the dequantised stacks
    (the reference)."""
    import dataclasses

    from flax import nnx

    config = dataclasses.replace(preset_config("tiny-moe"), hidden_size=128,
                                 moe_intermediate_size=128)
    layer = moe.MoE(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(np.random.randint(1 << 30)))
    for proj in (layer.experts.gate_up_proj, layer.experts.down_proj):
        proj.set_quantized(quantize(proj.weight[...], fmt))
        assert upcasts_in_registers(proj.quantized_weight())
    x = jax.random.normal(jax.random.key(np.random.randint(1 << 30)),
                          (tokens, config.hidden_size)).astype(jnp.bfloat16)
    calls = []
    want, got = (_block_through(monkeypatch, layer, (x,), impl, platform, calls, "rows_sorted")
                 for impl in ("reference", implementation))
    assert calls == [tokens > 1] * 4
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
