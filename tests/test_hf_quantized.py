"""HF checkpoints that arrive quantized (NVFP4 and FP8 compressed-tensors, block-FP8), read as
stored: the parts of each projection (and each expert's) written here from a tiny float model
by each format's published recipe, then read back, run, converted and planned."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxinfer import LLM
from jaxinfer.errors import JaxinferError
from jaxinfer.loading.checkpoint import convert
from jaxinfer.loading.hf_source import HFSource, hf_key
from jaxinfer.loading.plan import _native_formats
from jaxinfer.ops.quant import dequantize

from .conftest import VOCAB, make_hf_model
from .test_bad_input import _fails_cleanly

E4M3_MAX, E2M1_MAX = 448.0, 6.0
KV_BYTES = 64 << 20


def _e4m3(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.float8_e4m3fn)


def nvfp4_parts(w: np.ndarray):
    """compressed-tensors' NVFP4 of W [N, K] (float64 W' = e2m1 * scale / global)."""
    n, k = w.shape
    global_scale = np.float32(E4M3_MAX * E2M1_MAX / np.abs(w).max())
    groups = w.reshape(n, k // 16, 16)
    scale = _e4m3(global_scale * np.abs(groups).max(-1) / E2M1_MAX)  # [N, K / 16]
    step = scale.astype(np.float64) / global_scale
    q = np.clip(groups / np.where(step > 0, step, 1)[..., None], -6, 6)
    e2m1 = q.astype(np.float32).astype(ml_dtypes.float4_e2m1fn)
    codes = e2m1.view(np.uint8).reshape(n, k) & 0x0F
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    parts = {"weight_packed": packed, "weight_scale": scale,
             "weight_global_scale": np.array([global_scale], np.float32),
             "input_global_scale": np.array([1.0], np.float32)}
    return parts, (e2m1.astype(np.float64) * step[..., None]).reshape(n, k)


def fp8_channel_parts(w: np.ndarray):
    scale = (np.abs(w).max(1, keepdims=True) / E4M3_MAX).astype(np.float32)  # [N, 1]
    values = _e4m3(w / scale)
    return {"weight": values, "weight_scale": scale}, values.astype(np.float64) * scale


def fp8_block_parts(w: np.ndarray, block: int = 128):
    n, k = w.shape
    rows = -(-n // block)
    padded = np.zeros((rows * block, k), np.float64)
    padded[:n] = w
    absmax = np.abs(padded.reshape(rows, block, k // block, block)).max(axis=(1, 3))
    scale_inv = (absmax / E4M3_MAX).astype(np.float32)  # [ceil(N / 128), K / 128]
    full = np.repeat(np.repeat(scale_inv, block, 0), block, 1)[:n].astype(np.float64)
    values = _e4m3(w / full)
    return {"weight": values, "weight_scale_inv": scale_inv}, values.astype(np.float64) * full


FORMATS = {
    "nvfp4": (nvfp4_parts, {"quant_method": "compressed-tensors",
                            "format": "nvfp4-pack-quantized", "ignore": ["lm_head"],
                            "config_groups": {"group_0": {
                                "targets": ["Linear"],
                                "weights": {"num_bits": 4, "type": "float", "group_size": 16,
                                            "strategy": "tensor_group"},
                                "input_activations": {"num_bits": 4, "type": "float",
                                                      "group_size": 16, "dynamic": "local"}}}},
              0.3),
    "fp8": (fp8_channel_parts, {"quant_method": "compressed-tensors", "format": "float-quantized",
                                "ignore": ["lm_head"],
                                "config_groups": {"group_0": {
                                    "targets": ["Linear"],
                                    "weights": {"num_bits": 8, "type": "float",
                                                "strategy": "channel", "dynamic": False},
                                    "input_activations": {"num_bits": 8, "type": "float",
                                                          "strategy": "token",
                                                          "dynamic": True}}}},
            0.1),
    "fp8:g128:weight-only": (fp8_block_parts, {"quant_method": "fp8", "fmt": "e4m3",
                                               "activation_scheme": "dynamic",
                                               "weight_block_size": [128, 128]}, 0.1),
}


@pytest.fixture(scope="module")
def float_model(tmp_path_factory):
    """A tiny llama whose in_features (128, 256) hold whole 128-wide blocks."""
    return make_hf_model("llama", tmp_path_factory.mktemp("hfq") / "float", hidden_size=128,
                         intermediate_size=256)


def quantized_copy(src: Path, dst: Path, fmt: str, drop: str | None = None) -> dict:
    """dst: src with its decoder-block projections (experts' too) stored in `fmt` (config.json
    says so); returns the float64 W each projection stands for, by our key (dense ones) and
    by HF name (all). `drop`: a part left out."""
    make_parts, quantization_config, _ = FORMATS[fmt]
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    tensors, want = {}, {}
    for file in src.glob("*.safetensors"):
        with safe_open(file, framework="numpy") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
        (dst / file.name).unlink()
    out = {}
    for name, array in tensors.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            parts, w = make_parts(array.astype(np.float64))
            want[name] = w
            if hf_key(name):
                want[hf_key(name)] = w
            module = name.removesuffix(".weight")
            out |= {f"{module}.{p}": v for p, v in parts.items() if p != drop}
        else:
            out[name] = array
    save_file(out, dst / "model.safetensors")
    return want


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantized_hf_checkpoint_read_as_stored(fmt, float_model, tmp_path):
    src = tmp_path / "q"
    want = quantized_copy(float_model, src, fmt)
    source = HFSource(src)
    assert source.native_quantization == fmt
    want = {k: w for k, w in want.items() if not k.startswith("model.")}
    got = {k: a for k, a, _ in source.tensors() if k in want}
    assert set(got) == set(want) and len(want) == 14
    for key, w in got.items():  # each projection exactly as its parts define it
        assert w.kind == ("fp4" if fmt == "nvfp4" else "fp8"), key
        np.testing.assert_allclose(np.asarray(dequantize(w), np.float64), want[key],
                                   rtol=2e-7, atol=1e-30, err_msg=key)
    assert {k: str(f) for k, f in _native_formats(source).items()} == dict.fromkeys(want, fmt)

    rng = np.random.default_rng()
    prompts = [rng.integers(2, VOCAB, n).tolist() for n in (7, 30)]
    ref = LLM(float_model, dtype="float32", kv_cache_bytes=KV_BYTES).logits(prompts)
    direct = LLM(src, dtype="float32", kv_cache_bytes=KV_BYTES)
    assert direct.config.quantization == fmt
    assert direct.model.layers[0].mlp.down_proj.quantized
    logits = direct.logits(prompts)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(logits, ref, strict=True))
    assert 0 < diff <= FORMATS[fmt][2], diff
    # Converted as stored: the same weights, so the same logits; "none": float again.
    out = convert(src, tmp_path / "ckpt", "float32", progress=False)
    assert json.loads((out / "model_config.json").read_text())["quantization"] == fmt
    converted = LLM(out, kv_cache_bytes=KV_BYTES).logits(prompts)
    for a, b in zip(converted, logits, strict=True):
        np.testing.assert_array_equal(a, b)
    floats = convert(src, tmp_path / "float", "float32", quantize="none", progress=False)
    plain = LLM(floats, kv_cache_bytes=KV_BYTES)
    assert not plain.model.layers[0].mlp.down_proj.quantized
    w8a8 = fmt == "fp8"  # the float form's activations stay float
    for a, b in zip(plain.logits(prompts), logits, strict=True):
        np.testing.assert_allclose(a, b, atol=FORMATS[fmt][2] if w8a8 else 1e-3)


def test_missing_part_and_unknown_scheme_fail_cleanly(float_model, tmp_path):
    src = tmp_path / "q"
    quantized_copy(float_model, src, "nvfp4", drop="weight_global_scale")
    with pytest.raises(JaxinferError, match=r"_proj\.\* has no weight_global_scale"):
        list(HFSource(src).tensors())
    _fails_cleanly(["convert", src, tmp_path / "out"], "weight_global_scale", tmp_path / "out")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["format"] = "int-quantized"
    (src / "config.json").write_text(json.dumps(config))
    _fails_cleanly(["convert", src, tmp_path / "out"], "'int-quantized'", tmp_path / "out")
    config["quantization_config"] = {"quant_method": "awq"}
    (src / "config.json").write_text(json.dumps(config))
    _fails_cleanly(["convert", src, tmp_path / "out"], "'awq'", tmp_path / "out")


@pytest.fixture(scope="module")
def float_moe(tmp_path_factory):
    """A tiny Qwen3-MoE whose in_features are all 128 (whole 128-wide blocks)."""
    return make_hf_model("qwen3_moe", tmp_path_factory.mktemp("hfq") / "moe", hidden_size=128,
                         moe_intermediate_size=128)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8:g128:weight-only"])
def test_quantized_experts_read_as_stored(fmt, float_moe, tmp_path):
    src = tmp_path / "q"
    want = quantized_copy(float_moe, src, fmt)
    stacks = {k: w for k, w, _ in HFSource(src).tensors() if ".experts." in k}
    assert len(stacks) == 4  # gate_up and down, two layers
    for key, w in stacks.items():  # [E, ...]: expert e's gate rows, then its up rows
        assert w.kind == ("fp4" if fmt == "nvfp4" else "fp8") and w.shape[0] == 8
        layer, proj = key.split(".")[1], key.split(".")[4]
        names = ["gate_proj", "up_proj"] if proj == "gate_up_proj" else ["down_proj"]
        expected = np.stack([np.concatenate(
            [want[f"model.layers.{layer}.mlp.experts.{e}.{n}.weight"] for n in names])
            for e in range(8)])
        np.testing.assert_allclose(np.asarray(dequantize(w), np.float64), expected,
                                   rtol=2e-7, atol=1e-30, err_msg=key)
    rng = np.random.default_rng()
    prompt = rng.integers(2, VOCAB, 20).tolist()
    ref = LLM(float_moe, dtype="float32", kv_cache_bytes=KV_BYTES).logits([prompt])[0]
    direct = LLM(src, dtype="float32", kv_cache_bytes=KV_BYTES)
    assert direct.model.layers[0].mlp.experts.down_proj.quantized
    logits = direct.logits([prompt])[0]
    assert 0 < np.abs(logits - ref).max() <= FORMATS[fmt][2]
    out = convert(src, tmp_path / "ckpt", "float32", progress=False)
    np.testing.assert_array_equal(LLM(out, kv_cache_bytes=KV_BYTES).logits([prompt])[0],
                                  logits)
