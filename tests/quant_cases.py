"""Quantized matmul cases and an independent float64 NumPy oracle.

A case draws a fresh float W and activations x, quantizes W with
`jaxinfer.ops.quant.quantize`, and the oracle rebuilds W from the stored integers,
scales and offsets in float64 by its own arithmetic (not `dequantize`), then
computes x @ W^T. For W8A8 it also rounds x to e4m3 per token itself.
Shared by the tests of every implementation (reference, Pallas TPU, Mosaic GPU).
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np


@dataclasses.dataclass(frozen=True)
class Case:
    fmt: str  # a `jaxinfer.ops.quant.parse_format` spelling
    m: int
    n: int
    k: int
    dtype: str = "bfloat16"  # activations
    outliers: bool = False  # a few large weights per row (stress the scales)
    seed: int = 0


# Kernel-friendly shapes (N a multiple of 128, K of 256); M from 1 to a few hundred.
CASES = {
    "int8_m1": Case("int8", 1, 256, 512),
    "int8_m16": Case("int8", 16, 384, 256),
    "int8_m200": Case("int8", 200, 256, 512, outliers=True),
    "int8_g128_m3": Case("int8:g128", 3, 256, 512),
    "int8_g64_m64": Case("int8:g64", 64, 128, 512),
    "int8_g32_m9": Case("int8:g32", 9, 256, 256),
    "int8_g128_asym_m5": Case("int8:g128:asym", 5, 128, 512),
    "int4_m1": Case("int4", 1, 256, 512),
    "int4_m130": Case("int4", 130, 128, 256, outliers=True),
    "int4_g128_m1": Case("int4:g128", 1, 384, 512),
    "int4_g128_m16": Case("int4:g128", 16, 256, 1024),
    "int4_g64_m33": Case("int4:g64", 33, 256, 256),
    "int4_g32_m8": Case("int4:g32", 8, 128, 512),
    "int4_g32_asym_m2": Case("int4:g32:asym", 2, 256, 256),  # GGUF Q4_1's form
    "int4_g128_asym_m300": Case("int4:g128:asym", 300, 128, 256),
    "int8_f32_act": Case("int8:g64", 4, 128, 256, dtype="float32"),
    "int4_f16_act": Case("int4:g128", 4, 128, 256, dtype="float16"),
    "fp8_w8a8_m1": Case("fp8", 1, 256, 512),
    "fp8_w8a8_m256": Case("fp8", 256, 256, 256, outliers=True),
    "fp8_weight_only_m7": Case("fp8:weight-only", 7, 128, 512),
    "fp8_g128_weight_only_m5": Case("fp8:g128:weight-only", 5, 256, 512),
    "fp8_g128_w8a8_m5": Case("fp8:g128", 5, 256, 512),  # DeepSeek's blocks, fp8 activations
    # 5 groups: the blocks kernel's pairs of steps and the odd one after them
    "fp8_g64_w8a8_m130": Case("fp8:g64", 130, 128, 320, outliers=True),
    "mxfp4_m5": Case("mxfp4", 5, 256, 512),
    "nvfp4_m3": Case("nvfp4", 3, 256, 512),
    "nvfp4_m64": Case("nvfp4", 64, 128, 256, outliers=True),
}


def build(case: Case) -> dict:
    """{"w": float32 W [N, K], "x": x [M, K] as float32 (exactly representable in case.dtype)}."""
    rng = np.random.default_rng([case.seed, case.m, case.n, case.k])
    w = rng.standard_normal((case.n, case.k)).astype(np.float32) * 0.05
    w += rng.standard_normal((case.n, 1)).astype(np.float32) * 0.02  # row-dependent means
    if case.outliers:
        rows = np.arange(case.n)
        w[rows, rng.integers(0, case.k, case.n)] *= 40.0
    x = rng.standard_normal((case.m, case.k)).astype(np.float32)
    x = x.astype(np.dtype(case.dtype)).astype(np.float32)
    return {"w": w, "x": x}


def stored_weight(qw) -> np.ndarray:
    """float64 W [N, K] from a QuantizedWeight's stored parts, by the format's definition."""
    values = np.asarray(qw.values.astype(np.float32), np.float64)
    n, k = values.shape
    scales = np.asarray(qw.scales, np.float64)  # [K // g, N]
    g = k // scales.shape[0]
    w = values * np.repeat(scales.T, g, axis=1)
    if qw.offsets is not None:
        w += np.repeat(np.asarray(qw.offsets, np.float64).T, g, axis=1)
    return w


def oracle(case: Case, x: np.ndarray, qw) -> tuple[np.ndarray, np.ndarray]:
    """(x @ W^T in float64, an error allowance per output element).

    The allowance is a relative bound on the rounding a correct implementation
    may add on top of the stored weight: bf16 dequantised weights (2^-8) in the
    group-wise paths, times |x| @ |W|^T; for W8A8, the fp8 tensor cores' short
    accumulator (2^-12) plus one e4m3 step wherever x / scale sits on a rounding
    tie. A wrong scale, group or offset breaks it by orders of magnitude.
    """
    w = stored_weight(qw)
    x64 = x.astype(np.float64)
    tie_allowance = 0.0
    if qw.activations == "fp8":
        absmax = np.abs(x64).max(axis=1, keepdims=True)
        x_scale = np.where(absmax > 0, absmax / 448.0, 1.0)
        t = x64 / x_scale
        x64 = t.astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * x_scale
        # Where x / scale lands on a rounding tie, float32 arithmetic may pick either
        # neighbour: allow one e4m3 step (2^-3 relative, 2^-9 subnormal) there.
        step = np.where(np.abs(t) >= 2.0 ** -6,
                        2.0 ** (np.floor(np.log2(np.maximum(np.abs(t), 1e-30))) - 3), 2.0 ** -9)
        frac = np.abs(t) / step - np.floor(np.abs(t) / step)
        near_tie = np.abs(frac - 0.5) < 1e-4
        tie_allowance = (np.where(near_tie, step, 0.0) * x_scale) @ np.abs(w).T
        # Hopper's fp8 MMA accumulates with ~14 significant bits; group-wise weights the
        # reference dequantises to the activation dtype (bf16: 2^-8).
        rel = 2.0 ** -12 if qw.group_size == qw.shape[1] or case.dtype == "float32" \
            else 2.0 ** -8
    else:
        rel = 2.0 ** -8 if case.dtype != "float32" else 2.0 ** -20
    want = x64 @ w.T
    allowance = rel * (np.abs(x64) @ np.abs(w).T) + tie_allowance + 1e-6
    if case.dtype != "float32":  # the output itself is rounded to the activation dtype
        allowance += np.abs(want) * 2.0 ** -7
    return want, allowance
