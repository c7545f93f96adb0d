"""Pallas TPU grouped matmul, kernel-specific checks (interpret mode on the CPU): the work
list's invariants, small tiles (many tiles per expert and experts per tile, tail tiles),
W8A8, two interpreted cores, the error for inputs the kernel does not take, and the
Pallas -> Mosaic lowering at the TPU block defaults. The oracle cases every
implementation shares are in test_grouped_matmul.py."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import quant_cases
from grouped_cases import Case, build, oracle, stored_weights
from jax.experimental.pallas import tpu as pltpu

from jaxinfer.ops.grouped_matmul_registry import grouped_matmul
from jaxinfer.ops.quant import quantize
from jaxinfer.pallas_kernels import grouped_matmul as pallas_tpu_kernel
from jaxinfer.pallas_kernels.grouped_matmul import (
    grouped_matmul_tpu,
    unsupported_reason,
    work_list,
)


def _sizes_samples(rng, e: int, m: int, count: int):
    """Group sizes of every kind: random, empty experts, one expert, short totals, none."""
    yield np.zeros(e, np.int32)
    yield np.full(e, m // e, np.int32)
    for _ in range(count):
        live = rng.random(e) < rng.uniform(0.2, 1.0)
        total = int(rng.integers(0, m + 1))
        weights = rng.random(e) * live
        if weights.sum() == 0:
            weights[rng.integers(e)] = 1.0
        sizes = np.floor(weights / weights.sum() * total).astype(np.int32)
        yield sizes


@pytest.mark.parametrize("bm", [8, 16, 32])
def test_work_list_visits_every_intersection_once_in_tile_order(bm):
    rng = np.random.default_rng(0)
    e, m = 6, 100
    tiles_m = -(-m // bm)
    fn = jax.jit(work_list, static_argnums=(1, 2))
    for sizes in _sizes_samples(rng, e, m, 40):
        metadata, num_visits = fn(jnp.asarray(sizes), tiles_m, bm)
        out_tile, in_tile, expert, rows = map(np.asarray, metadata)
        rows = rows.reshape(-1, 2)
        ends = np.cumsum(sizes)
        starts = ends - sizes
        live = rows[:, 1] > rows[:, 0]
        # Expected (expert, tile) pairs: each non-empty expert and every tile it touches.
        want = [(g, t) for g in range(e) if sizes[g]
                for t in range(starts[g] // bm, (ends[g] - 1) // bm + 1)]
        assert list(zip(expert[live], out_tile[live], strict=True)) == want
        assert live[:len(want)].all() and not live[len(want):].any()  # live visits first
        for g, (r0, r1) in zip(expert[live], rows[live], strict=True):
            assert (r0, r1) == (starts[g], ends[g])
        # Output blocks are revisited only consecutively, and every tile is visited.
        assert (np.diff(out_tile) >= 0).all() and set(out_tile) == set(range(tiles_m))
        # The grid runs the live visits and one per tile no expert touches.
        assert num_visits == len(want) + tiles_m - len(set(out_tile[live]))
        assert set(out_tile[:num_visits]) == set(range(tiles_m))
        # Dead visits repeat the last live visit's input blocks (no new DMA).
        if len(want):
            assert (in_tile[~live] == out_tile[len(want) - 1]).all()
            assert (expert[~live] == want[-1][0]).all()


CASES = {
    # Small m-tiles: experts spanning several tiles, tiles holding several experts,
    # tail tiles (rows past the total) and spare visits.
    "bf16_bm16": (Case(100, 6, 256, 256, "partial"), dict(block_m=16, block_k=128)),
    "bf16_empty_bm16": (Case(64, 8, 128, 256, "empty"), dict(block_m=16)),
    "f32_bm8": (Case(40, 4, 128, 256, "partial", dtype="float32"), dict(block_m=8)),
    "int8_bm16_bk128": (Case(50, 4, 256, 512, fmt="int8"), dict(block_m=16, block_k=128)),
    "int4_g64_asym_bm16": (Case(40, 4, 128, 256, "partial", fmt="int4:g64:asym"),
                           dict(block_m=16, block_k=128)),
    "mxfp4_bm16": (Case(40, 4, 128, 256, "one", fmt="mxfp4"), dict(block_m=16)),
}


def _run(case: Case, **kwargs):
    b = build(case)
    with jax.default_matmul_precision("highest"):
        w = quantize(b["w"], case.fmt) if case.fmt else jnp.asarray(b["w"], case.dtype)
        x = jnp.asarray(b["x"], case.dtype)
        y = grouped_matmul_tpu(x, w, jnp.asarray(b["sizes"]), **kwargs)
    assert y.dtype == x.dtype and y.shape == (case.m, case.n)
    return b, w, np.asarray(y.astype(jnp.float32), np.float64)


@pytest.mark.parametrize("name", list(CASES))
def test_small_tiles_match_oracle(name):
    case, blocks = CASES[name]
    b, w, y = _run(case, **blocks)
    want, allowance = oracle(case, b["x"], stored_weights(case, w), b["sizes"])
    assert np.isfinite(y).all(), "non-finite outputs (unwritten rows?)"
    assert (y[b["sizes"].sum():] == 0).all(), "rows past the total must be exact zeros"
    assert (np.abs(y - want) <= allowance).all()


def test_no_rows_in_any_group_gives_zeros():
    x = jnp.ones((40, 256), jnp.bfloat16)
    w = jnp.ones((3, 128, 256), jnp.bfloat16)
    y = grouped_matmul_tpu(x, w, jnp.zeros(3, jnp.int32), block_m=16)
    assert (np.asarray(y.astype(jnp.float32)) == 0).all()


def test_two_cores_split_n_blocks():
    """Megacore: the N axis is "parallel"; two interpreted cores split it."""
    case = Case(48, 4, 256, 256, "partial")
    params = pltpu.InterpretParams(num_cores_or_threads=2)
    b, w, y = _run(case, block_m=16, interpret=params)
    want, allowance = oracle(case, b["x"], stored_weights(case, w), b["sizes"])
    assert (np.abs(y - want) <= allowance).all()


def test_w8a8_matches_per_expert_oracle():
    """W8A8 rows are quantized per token, so each expert's rows follow the dense W8A8
    oracle of quant_cases (its own e4m3 rounding of x, float64)."""
    case = Case(70, 4, 256, 256, "partial", fmt="fp8")
    b, w, y = _run(case, block_m=32)
    start = 0
    for e, size in enumerate(b["sizes"]):
        rows = slice(start, start + int(size))
        want, allowance = quant_cases.oracle(quant_cases.Case("fp8", int(size), case.n, case.k),
                                             b["x"][rows], w.expert(e))
        assert (np.abs(y[rows] - want) <= allowance).all(), f"expert {e}"
        start += int(size)
    assert (y[start:] == 0).all()


@pytest.mark.parametrize("x_shape,w_shape,x_dtype,match", [
    ((8, 256), (4, 100, 256), jnp.bfloat16, "N=100 is not a multiple of 128"),
    ((8, 96), (4, 128, 96), jnp.int8, "x dtype int8"),
])
def test_forced_kernel_raises_the_unsupported_reason(x_shape, w_shape, x_dtype, match):
    x = jnp.ones(x_shape, x_dtype)
    w = jnp.ones(w_shape, jnp.bfloat16)
    sizes = jnp.array([4, 4, 0, 0], jnp.int32)
    reason = unsupported_reason(x, w)
    assert reason is not None and match in reason
    with pytest.raises(ValueError, match=re.escape(reason)):
        grouped_matmul(x, w, sizes, implementation="pallas_tpu")


@pytest.mark.parametrize("fmt", [None, "int8:g32:asym", "fp8", "mxfp4"])
def test_lowers_to_mosaic_with_tpu_blocks(fmt, monkeypatch):
    """Exports for TPU at the TPU block defaults (Pallas -> Mosaic lowering; not the Mosaic
    compiler, which needs a TPU)."""
    from jax import export

    monkeypatch.setattr(pallas_tpu_kernel, "running_on_tpu", lambda: True)
    w = np.random.default_rng(0).standard_normal((4, 512, 512)).astype(np.float32)
    w = quantize(w, fmt) if fmt else jnp.asarray(w, jnp.bfloat16)
    x = jax.ShapeDtypeStruct((96, 512), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
    fn = jax.jit(lambda x, w, s: grouped_matmul_tpu(x, w, s, interpret=False))
    exported = export.export(fn, platforms=("tpu",))(x, w, sizes)
    assert "tpu_custom_call" in exported.mlir_module()
