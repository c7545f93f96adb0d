"""Reads an HF model directory: config.json, (sharded) safetensors, tokenizer files.

Tensors are yielded one at a time under our checkpoint keys (see
`jaxinfer.models.Decoder`), so a converter never holds the whole model; an MoE
layer's expert weights, stored per expert (Mixtral, Qwen-MoE) or split into parts
(gpt-oss), are held until their stack is complete (`ExpertStacks`), and so are the parts
of a projection stored quantized (`jaxinfer.loading.hf_quantized`: NVFP4 and FP8
checkpoints). Pickle weights (`pytorch_model.bin`) are never loaded.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from safetensors import safe_open

from jaxinfer.config import ModelConfig, config_from_hf, read_json
from jaxinfer.errors import JaxinferError
from jaxinfer.loading.hf_quantized import (
    FLOAT8,
    Float8Reader,
    join_parts,
    quant_scheme,
    unpack_fp4,
)
from jaxinfer.loading.tokenizer import TOKENIZER_FILES
from jaxinfer.ops.quant import QuantizedWeight, dequantize

_LAYER_NAMES = {
    "input_layernorm.weight": "input_norm.scale",
    "post_attention_layernorm.weight": "post_attn_norm.scale",
    "self_attn.q_norm.weight": "attn.q_norm.scale",
    "self_attn.k_norm.weight": "attn.k_norm.scale",
    # MoE routers: Qwen-MoE, Mixtral, gpt-oss
    "mlp.gate.weight": "mlp.router.weight",
    "block_sparse_moe.gate.weight": "mlp.router.weight",
}
# One expert's projection (Qwen-MoE gate/up/down_proj, Mixtral w1/w3/w2) -> its stack.
_EXPERT_RE = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_EXPERT_PROJ = {"gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0),
                "up_proj": ("gate_up_proj", 1), "w3": ("gate_up_proj", 1),
                "down_proj": ("down_proj", 0), "w2": ("down_proj", 0)}
# gpt-oss stores each layer's experts whole: bf16 (in-major, gate/up interleaved) or MXFP4.
_FUSED_EXPERTS = re.compile(r"mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?")
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
# A tensor of a layer's module: (module prefix, suffix), e.g. ("...q_proj.", "weight_scale").
_MODULE_PART_RE = re.compile(r"(model\.layers\.\d+\..+\.)(weight\w*|input\w*)")


def hf_key(name: str) -> str | None:
    """HF tensor name -> our checkpoint key (None for tensors we do not use)."""
    if name == "model.embed_tokens.weight":
        return "embed.embedding"
    if name == "model.norm.weight":
        return "final_norm.scale"
    if name == "lm_head.weight":
        return "lm_head"
    m = _LAYER_RE.fullmatch(name)
    if m is None:
        return None
    layer, rest = m.groups()
    if _EXPERT_RE.fullmatch(rest) or _FUSED_EXPERTS.fullmatch(rest):
        return None  # assembled by ExpertStacks
    if rest in _LAYER_NAMES:
        rest = _LAYER_NAMES[rest]
    elif rest.startswith("self_attn."):
        rest = "attn." + rest.removeprefix("self_attn.")
    elif not rest.startswith("mlp."):
        return None  # e.g. self_attn.rotary_emb.inv_freq in old checkpoints
    return f"layers.{layer}.{rest}"


def expert_stack_key(name: str) -> str | None:
    """HF name of one expert's projection weight (Qwen-MoE, Mixtral) -> our key of the stack
    it joins (None for other tensors)."""
    m = _LAYER_RE.fullmatch(name)
    em = m and _EXPERT_RE.fullmatch(m.group(2))
    stack = em and _EXPERT_PROJ.get(em.group(2), (None,))[0]
    return f"layers.{m.group(1)}.mlp.experts.{stack}.weight" if stack else None


def _stack(weights: list, axis: int = 0):
    """np.stack of float arrays or of QuantizedWeights (values [.., N, K] and scales
    [.., K / g, N]: along N means axis -2 of the values and -1 of the scales); axis: 0 (a
    new leading expert axis) or 1 (concatenated along N, the gate rows then the up rows)."""
    quantized = [isinstance(w, QuantizedWeight) for w in weights]
    if any(quantized) and not all(quantized):
        raise JaxinferError("an expert stack mixes quantized and float experts")
    join = np.stack if axis == 0 else np.concatenate
    if not any(quantized):
        return join(weights, axis=axis)
    return QuantizedWeight(join([w.values for w in weights], axis=axis),
                           join([w.scales for w in weights], axis=0 if axis == 0 else 2))


def _deinterleave(a: np.ndarray, axis: int) -> np.ndarray:
    """gpt-oss interleaves gate and up (gate, up, gate, ...): -> all gates, then all ups."""
    even = np.take(a, np.arange(0, a.shape[axis], 2), axis=axis)
    odd = np.take(a, np.arange(1, a.shape[axis], 2), axis=axis)
    return np.concatenate([even, odd], axis=axis)


def mxfp4_weight(blocks: np.ndarray, scales: np.ndarray) -> QuantizedWeight:
    """MXFP4 parts -> a stacked fp4 QuantizedWeight W [E, N, K].

    blocks [E, N, K // 32, 16] uint8: two e2m1 codes per byte, the low nibble first;
    scales [E, N, K // 32] uint8: e8m0 exponents (scale = 2^(s - 127)) of each 32 values.
    """
    e, n, groups, _ = blocks.shape
    values = unpack_fp4(blocks.reshape(e, n, groups * 16))
    exps = np.swapaxes(scales.astype(np.float32) - 127.0, 1, 2)  # [E, K // 32, N]
    return QuantizedWeight(values, np.exp2(exps).astype(np.float32))


class ExpertStacks:
    """Collects one layer's expert tensors until a stack is complete, then returns it.

    Stacks (our keys): layers.{i}.mlp.experts.gate_up_proj.weight [E, 2I, H] (all gate
    rows, then all up rows), .bias [E, 2I], and down_proj.weight [E, H, I], .bias [E, H].
    """

    def __init__(self, config: ModelConfig):
        self.num_experts = config.num_experts
        self.parts: dict[str, dict] = {}

    def add(self, name: str, array) -> list[tuple[str, object]]:
        """An HF tensor (or one expert's QuantizedWeight under its `weight` name) -> the
        (key, stack) pairs it completes (none if still partial)."""
        m = _LAYER_RE.fullmatch(name)
        if m is None:
            return []
        layer, rest = m.groups()
        prefix = f"layers.{layer}.mlp.experts."
        if em := _EXPERT_RE.fullmatch(rest):
            stack, half = _EXPERT_PROJ.get(em.group(2), (None, None))
            if stack is None:
                return []
            need = self.num_experts * (2 if stack == "gate_up_proj" else 1)
            parts = self._put(prefix + stack + ".weight", (half, int(em.group(1))), array, need)
            if parts is None:
                return []
            halves = [_stack([parts[(h, e)] for e in range(self.num_experts)])
                      for h in sorted({h for h, _ in parts})]
            return [(prefix + stack + ".weight", _stack(halves, axis=1))]
        if fm := _FUSED_EXPERTS.fullmatch(rest):
            stack, suffix = fm.group(1), fm.group(2) or ""
            gate_up = stack == "gate_up_proj"
            if suffix == "_bias":
                return [(prefix + stack + ".bias", _deinterleave(array, 1) if gate_up
                         else array)]
            if suffix == "":  # bf16: [E, in, out] -> [E, out, in]
                w = np.swapaxes(array, 1, 2)
                return [(prefix + stack + ".weight", _deinterleave(w, 1) if gate_up else w)]
            parts = self._put(prefix + stack + ".weight", suffix, array, need=2)
            if parts is None:
                return []
            w = mxfp4_weight(parts["_blocks"], parts["_scales"])
            if gate_up:
                w = QuantizedWeight(_deinterleave(w.values, 1), _deinterleave(w.scales, 2))
            return [(prefix + stack + ".weight", w)]
        return []

    @staticmethod
    def holds(name: str) -> bool:
        """Whether HF tensor `name` is part of an expert stack."""
        m = _LAYER_RE.fullmatch(name)
        return m is not None and bool(_EXPERT_RE.fullmatch(m.group(2))
                                      or _FUSED_EXPERTS.fullmatch(m.group(2)))

    def _put(self, key: str, part, array, need: int) -> dict | None:
        """Adds a part of stack `key`; once it has `need` parts, removes them from the
        buffer (which holds only incomplete stacks) and returns them, else None."""
        parts = self.parts.setdefault(key, {})
        parts[part] = array
        return self.parts.pop(key) if len(parts) >= need else None


class HFSource:
    """An HF checkpoint directory."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise JaxinferError(f"{self.path}: not a directory")
        hf_config = read_json(self.path / "config.json")
        self.config: ModelConfig = config_from_hf(hf_config, str(self.path / "config.json"))
        # How its quantized projections are stored (None: float, or gpt-oss's MXFP4 experts)
        self.scheme = quant_scheme(hf_config, str(self.path / "config.json"))
        gen = self.path / "generation_config.json"
        if gen.exists():
            eos = read_json(gen).get("eos_token_id")
            eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
            merged = tuple(dict.fromkeys([*self.config.eos_token_ids, *eos]))
            self.config = dataclasses.replace(self.config, eos_token_ids=merged)
        self.files = self._weight_files()

    @property
    def native_quantization(self) -> str:
        """The `ModelConfig.quantization` of the tensors read as stored: the scheme's format,
        or "mxfp4" (gpt-oss's experts)."""
        return self.scheme.format if self.scheme else "mxfp4"

    def _weight_files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise JaxinferError(f"{index}: missing field 'weight_map'")
            files = [self.path / f for f in dict.fromkeys(weight_map.values())]
        else:
            files = sorted(self.path.glob("*.safetensors"))
        if not files:
            pickles = list(self.path.glob("*.bin")) + list(self.path.glob("*.pt"))
            hint = " (pickle weights are not loaded: save them as safetensors)" if pickles else ""
            raise JaxinferError(f"{self.path}: no *.safetensors weight files{hint}")
        for f in files:
            if not f.exists():
                raise JaxinferError(f"{f}: weight file listed in the index is missing")
        return files

    def tensors(self, native: bool = True) -> Iterator[tuple[str, np.ndarray, str]]:
        """Yields (our key, array as stored, source file name), one tensor at a time.

        Quantized projections (`self.scheme`) and MXFP4 experts (gpt-oss) come as a
        `QuantizedWeight` if `native`, else dequantized to float32.
        """
        stacks = ExpertStacks(self.config)
        held: dict[str, dict[str, np.ndarray]] = {}  # a quantized projection's parts so far
        for file in self.files:
            try:
                with safe_open(file, framework="numpy") as f:
                    float8 = None
                    for name in f.keys():
                        if f.get_slice(name).get_dtype() in FLOAT8:
                            float8 = float8 or Float8Reader(file)
                            array = float8.read(name)
                        else:
                            array = f.get_tensor(name)
                        part = self._quantized_part(name, array)
                        if part is not None:
                            base, suffix = part
                            if not suffix:
                                continue  # a part not read (activation scales)
                            got = held.setdefault(base, {})
                            got[suffix] = array
                            if set(got) == set(self.scheme.parts()):
                                del held[base]
                                w = join_parts(self.scheme, got, f"{file}: {base}*")
                                key = hf_key(base + "weight")
                                done = [(key, w)] if key else stacks.add(base + "weight", w)
                                for key, w in done:
                                    yield key, (w if native or not isinstance(
                                        w, QuantizedWeight) else np.asarray(dequantize(w))), \
                                        file.name
                            continue
                        key = hf_key(name)
                        if key is not None:
                            yield key, array, file.name
                        elif stacks.holds(name):
                            for key, stack in stacks.add(name, array):
                                if isinstance(stack, QuantizedWeight) and not native:
                                    stack = np.asarray(dequantize(stack))
                                yield key, stack, file.name
            except JaxinferError:
                raise
            except Exception as e:  # safetensors raises its own types for bad files
                raise JaxinferError(f"{file}: truncated or corrupt safetensors file ({e})") \
                    from None
        for base, got in held.items():
            missing = sorted(set(self.scheme.parts()) - set(got))
            raise JaxinferError(f"{self.path}: {base}* has no {', '.join(missing)} "
                                f"({self.scheme.format} projections store "
                                f"{', '.join(self.scheme.parts())})")

    def _quantized_part(self, name: str, array: np.ndarray) -> tuple[str, str] | None:
        """(module prefix, suffix) if HF tensor `name` is a part of a projection (or of one
        expert's) stored quantized (a float `weight` is a module the scheme left out); None
        otherwise. Parts the scheme stores but we do not read are skipped here too (their
        suffix: "")."""
        m = self.scheme and _MODULE_PART_RE.fullmatch(name)
        if not m:
            return None
        base, suffix = m.groups()
        if suffix in self.scheme.unused:
            return base, ""
        if suffix not in self.scheme.parts() or (
                suffix == "weight" and array.dtype not in FLOAT8.values()):
            return None
        if hf_key(base + "weight") is None and expert_stack_key(base + "weight") is None:
            return None
        return base, suffix

    def tokenizer_files(self) -> dict[str, bytes]:
        """The tokenizer and generation files present, by name."""
        return {n: (self.path / n).read_bytes() for n in TOKENIZER_FILES
                if (self.path / n).exists()}

