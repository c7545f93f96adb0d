"""Quantized HF checkpoints read as they are stored: the scheme config.json's
`quantization_config` names, and each projection's parts joined into a `QuantizedWeight`.

Schemes (the decoder-block projections, and experts stored one at a time, which
`hf_source.ExpertStacks` then stacks):
- compressed-tensors, format "nvfp4-pack-quantized" (NVFP4): `weight_packed` uint8 [N, K / 2]
  (two e2m1 codes a byte, the low nibble first), `weight_scale` float8_e4m3fn [N, K / 16],
  `weight_global_scale` float32 [1]: W = e2m1 * weight_scale / weight_global_scale -> "nvfp4".
  Its activation scales (`input_global_scale`, for W4A4) are not used: the weights run
  against bf16 activations.
- compressed-tensors, format "float-quantized" (FP8): `weight` float8_e4m3fn [N, K] and
  `weight_scale` float32 [N, 1] (per channel), [1] (per tensor) or [N / bn, K / bk] (blocks):
  W = weight * weight_scale -> "fp8" (per channel or tensor with dynamic fp8 activations:
  W8A8), "fp8:weight-only" (other activations), "fp8:g{bk}:weight-only" (blocks).
- quant_method "fp8" with `weight_block_size` [bn, bk] (DeepSeek-V3, Qwen3's FP8 releases):
  `weight` float8_e4m3fn [N, K] and `weight_scale_inv` float32 [ceil(N / bn), ceil(K / bk)]:
  W = weight * weight_scale_inv (a multiplier, despite its name) -> "fp8:g{bk}:weight-only".
Modules a scheme leaves out (its `ignore` list: lm_head, often) are plain float tensors.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxinfer.errors import JaxinferError
from jaxinfer.ops.quant import GROUP_SIZES, NVFP4_GROUP, QuantizedWeight

FLOAT8 = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """How a checkpoint stores its quantized projections (see the module docstring)."""

    format: str  # the `ModelConfig.quantization` of the projections read as stored
    values: str  # suffix of a projection's values: "weight" or "weight_packed"
    scales: tuple[str, ...]  # suffixes of its other parts
    unused: tuple[str, ...] = ()  # suffixes of its tensors that are not read
    block: tuple[int, int] | None = None  # (rows, columns) of W that share a scale

    def parts(self) -> tuple[str, ...]:
        return (self.values, *self.scales)


def quant_scheme(hf_config: dict, where: str) -> QuantScheme | None:
    """The scheme of config.json's `quantization_config` (None: float weights, or gpt-oss's
    MXFP4 experts, which `hf_source.ExpertStacks` reads). Unknown schemes are refused."""
    qc = hf_config.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") == "mxfp4":
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and block[1] in GROUP_SIZES):
            raise JaxinferError(f"{where}: quantization_config.weight_block_size {block!r}: "
                                f"expected [rows, columns], columns one of {GROUP_SIZES}")
        return QuantScheme(f"fp8:g{block[1]}:weight-only", "weight", ("weight_scale_inv",),
                           ("input_scale",), tuple(block))
    if method == "compressed-tensors":
        fmt = qc.get("format")
        groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
        weights = (groups[0].get("weights") or {}) if len(groups) == 1 else {}
        inputs = (groups[0].get("input_activations") or {}) if len(groups) == 1 else {}
        if fmt == "nvfp4-pack-quantized" and weights.get("group_size") == NVFP4_GROUP:
            return QuantScheme("nvfp4", "weight_packed", ("weight_scale", "weight_global_scale"),
                               ("input_global_scale",))
        if fmt == "float-quantized" and weights.get("num_bits") == 8 \
                and weights.get("type") == "float":
            strategy = weights.get("strategy")
            unused = ("input_scale",)
            if strategy in ("channel", "tensor"):
                w8a8 = (inputs.get("type") == "float" and inputs.get("num_bits") == 8
                        and inputs.get("dynamic") is True)
                return QuantScheme("fp8" if w8a8 else "fp8:weight-only", "weight",
                                   ("weight_scale",), unused)
            block = weights.get("block_structure")
            if strategy == "block" and isinstance(block, list) and len(block) == 2 \
                    and block[1] in GROUP_SIZES:
                return QuantScheme(f"fp8:g{block[1]}:weight-only", "weight",
                                   ("weight_scale",), unused, tuple(block))
        raise JaxinferError(
            f"{where}: quantization_config: compressed-tensors format {fmt!r} with "
            f"{len(groups)} config group(s) is not read (single-group NVFP4 and FP8 are)")
    raise JaxinferError(f"{where}: quantization_config.quant_method {method!r} is not read "
                        "(compressed-tensors NVFP4 / FP8, fp8 with weight blocks and mxfp4 are)")


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., B] holding two e2m1 codes a byte, the low nibble first (MXFP4's and
    NVFP4's packing) -> float4_e2m1fn [..., 2 B]."""
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1)
    return codes.reshape(*packed.shape[:-1], -1).astype(np.uint8).view(ml_dtypes.float4_e2m1fn)


def join_parts(scheme: QuantScheme, parts: dict[str, np.ndarray], where: str) -> QuantizedWeight:
    """A projection's stored parts (by suffix) -> its QuantizedWeight W [N, K]."""
    values = parts[scheme.values]
    if scheme.format == "nvfp4":
        n, half = values.shape
        e2m1 = unpack_fp4(values)
        block = parts["weight_scale"].astype(np.float32)  # [N, K / 16]
        global_scale = np.asarray(parts["weight_global_scale"], np.float32).reshape(-1)[0]
        if block.shape != (n, 2 * half // NVFP4_GROUP):
            raise JaxinferError(f"{where}: weight_scale has shape {block.shape}, expected "
                                f"{(n, 2 * half // NVFP4_GROUP)} for values [{n}, {2 * half}]")
        return QuantizedWeight(e2m1, (block / global_scale).T.copy())
    if values.dtype != ml_dtypes.float8_e4m3fn:
        raise JaxinferError(f"{where}: values are {values.dtype}, expected float8_e4m3fn")
    n, k = values.shape
    scale = np.asarray(parts[scheme.scales[0]], np.float32)
    if scheme.block is not None:
        bn, bk = scheme.block
        want = (-(-n // bn), -(-k // bk))
        if scale.shape != want or k % bk:
            raise JaxinferError(f"{where}: {scheme.scales[0]} has shape {scale.shape} for "
                                f"values [{n}, {k}] in blocks of {bn} x {bk} (expected {want}, "
                                f"K a multiple of {bk})")
        return QuantizedWeight(values, np.repeat(scale, bn, axis=0)[:n].T.copy())
    if scale.size == 1:  # per tensor
        return QuantizedWeight(values, np.full((1, n), scale.reshape(-1)[0], np.float32))
    if scale.shape != (n, 1):
        raise JaxinferError(f"{where}: weight_scale has shape {scale.shape}, expected [{n}, 1] "
                            "or [1]")
    return QuantizedWeight(values, scale.T.copy())


class Float8Reader:
    """Reads a safetensors file's float8 tensors, which safetensors' numpy loader cannot type
    (numpy has no float8): the file's header gives the bytes, ml_dtypes the type."""

    def __init__(self, path: Path):
        self.path = Path(path)
        with open(self.path, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            self.header = json.loads(fh.read(size))
        self.start = 8 + size

    def read(self, name: str) -> np.ndarray:
        info = self.header[name]
        begin, end = info["data_offsets"]
        raw = np.fromfile(self.path, np.uint8, count=end - begin, offset=self.start + begin)
        return raw.view(FLOAT8[info["dtype"]]).reshape(info["shape"])
