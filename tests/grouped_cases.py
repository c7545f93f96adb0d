"""Grouped matmul cases and an independent float64 NumPy oracle.

A case draws fresh expert weights W [E, N, K] (quantized with `jaxinfer.ops.quant.quantize`
when it names a format), rows x [M, K] and group sizes of a given kind; the oracle
rebuilds each expert's W in float64 from the stored parts by its own arithmetic and
multiplies row by row. Shared by the tests of every implementation.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from quant_cases import stored_weight


@dataclasses.dataclass(frozen=True)
class Case:
    m: int  # rows (tokens x top-k)
    e: int  # experts
    n: int
    k: int
    sizes: str = "random"  # random | empty (some experts get no rows) | one (all rows on one
    #                        expert) | partial (sum(group_sizes) < m: the tail rows are zero)
    fmt: str | None = None  # None: float weights in `dtype`; else a quant format spelling
    dtype: str = "bfloat16"
    seed: int = 0


# Kernel-friendly shapes (N a multiple of 128, K of 256).
CASES = {
    "bf16_decode": Case(8, 8, 256, 512, "empty"),
    "bf16_m1": Case(1, 4, 128, 256, "one"),
    "bf16_random": Case(100, 6, 256, 256),
    "bf16_one_expert": Case(64, 8, 128, 512, "one"),
    "bf16_partial": Case(48, 4, 128, 256, "partial"),
    "bf16_many_rows": Case(600, 4, 256, 256),
    "f32_random": Case(40, 4, 128, 256, dtype="float32"),
    "f16_empty": Case(24, 8, 128, 256, "empty", dtype="float16"),
    "int8_decode": Case(8, 8, 256, 512, "empty", fmt="int8"),
    "int8_g128_random": Case(70, 4, 128, 512, fmt="int8:g128"),
    "int4_g128_one": Case(16, 4, 128, 512, "one", fmt="int4:g128"),
    "int4_g32_asym": Case(33, 4, 128, 256, fmt="int4:g32:asym"),
    "fp8_weight_only": Case(20, 4, 128, 256, "empty", fmt="fp8:weight-only"),
    "mxfp4_random": Case(40, 4, 256, 256, "partial", fmt="mxfp4"),
    "mxfp4_decode": Case(4, 8, 256, 256, "empty", fmt="mxfp4"),
    "nvfp4_decode": Case(4, 8, 128, 256, "empty", fmt="nvfp4"),
    "int4_g32_asym_decode": Case(8, 8, 128, 256, fmt="int4:g32:asym"),
}


def group_sizes(case: Case, rng: np.random.Generator) -> np.ndarray:
    """[E] int32 row counts of the case's kind."""
    e, m = case.e, case.m
    if case.sizes == "one":
        sizes = np.zeros(e, np.int64)
        sizes[rng.integers(e)] = m
        return sizes.astype(np.int32)
    total = m - rng.integers(1, max(2, m // 3) + 1) if case.sizes == "partial" else m
    # "empty": half the experts take no rows; the rest split the total at random cuts.
    live = np.sort(rng.permutation(e)[: max(1, e - e // 2)]) if case.sizes == "empty" \
        else np.arange(e)
    cuts = np.sort(rng.choice(np.arange(total + 1), len(live) - 1))
    sizes = np.zeros(e, np.int64)
    sizes[live] = np.diff(np.concatenate([[0], cuts, [total]]))
    return sizes.astype(np.int32)


def build(case: Case) -> dict:
    """{"w": float32 W [E, N, K], "x": float32 x [M, K] (exact in case.dtype), "sizes": [E]}."""
    rng = np.random.default_rng()
    w = rng.standard_normal((case.e, case.n, case.k)).astype(np.float32) * 0.05
    w += rng.standard_normal((case.e, case.n, 1)).astype(np.float32) * 0.02
    x = rng.standard_normal((case.m, case.k)).astype(np.float32)
    x = x.astype(np.dtype(case.dtype)).astype(np.float32)
    sizes = group_sizes(case, rng)
    assert sizes.sum() <= case.m and (sizes >= 0).all()
    return {"w": w, "x": x, "sizes": sizes}


def stored_weights(case: Case, w) -> np.ndarray:
    """float64 W [E, N, K]: the float weights as rounded to the case dtype, or each
    expert's quantized parts rebuilt by the format's definition."""
    if case.fmt is None:
        return np.asarray(np.asarray(w).astype(np.float32), np.float64)
    return np.stack([stored_weight(w.expert(e)) for e in range(case.e)])


def oracle(case: Case, x: np.ndarray, w64: np.ndarray, sizes: np.ndarray):
    """(y [M, N] in float64, an error allowance per element).

    Row r of expert e's range gets x[r] @ W[e]^T; rows past sum(sizes) are 0. The
    allowance: bf16 / f16 operands (2^-8 relative of |x| @ |W|^T, e.g. weights upcast
    and rounded in the kernels), plus the output's own rounding.
    """
    x64 = x.astype(np.float64)
    want = np.zeros((case.m, case.n))
    scale = np.zeros((case.m, case.n))
    start = 0
    for e, size in enumerate(sizes):
        rows = slice(start, start + int(size))
        want[rows] = x64[rows] @ w64[e].T
        scale[rows] = np.abs(x64[rows]) @ np.abs(w64[e]).T
        start += int(size)
    rel = 2.0 ** -20 if case.dtype == "float32" else 2.0 ** -8
    allowance = rel * scale + 1e-6
    if case.dtype != "float32":
        allowance += np.abs(want) * 2.0 ** -7
    return want, allowance
