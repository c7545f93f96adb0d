"""Every `grouped_matmul` implementation against an independent float64 oracle (cases in
grouped_cases.py): random group sizes, empty experts, all rows on one expert, rows past
the groups' total, float and quantized expert weights.

Kernels run in interpret mode on the CPU (Mosaic GPU: uninitialised memory reads as
NaN, so an unwritten output element fails) and natively under `pytest -m gpu`.
"""

from __future__ import annotations

import functools
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from grouped_cases import CASES, Case, build, oracle, stored_weights

from jaxinfer.ops.grouped_matmul import RowGroups, grouped_matmul
from jaxinfer.ops.quant import quantize

gpu = pytest.mark.gpu
BACKENDS = [
    ("reference", "cpu"), pytest.param("reference", "gpu", marks=gpu),
    ("mosaic_gpu", "cpu"), pytest.param("mosaic_gpu", "gpu", marks=gpu),
    ("pallas_tpu", "cpu"),
]
KERNEL_MODULES = {"mosaic_gpu": "jaxinfer.mosaic.grouped_matmul",
                  "pallas_tpu": "jaxinfer.pallas_kernels.grouped_matmul"}


def run(case: Case, implementation: str, platform: str, swiglu: bool = False):
    b = build(case)
    with jax.default_device(jax.devices(platform)[0]), jax.default_matmul_precision("highest"):
        w = (quantize(b["w"], case.fmt) if case.fmt
             else jnp.asarray(b["w"], case.dtype))
        x = jnp.asarray(b["x"], case.dtype)
        sizes = jnp.asarray(b["sizes"])
        if implementation != "reference":
            module = importlib.import_module(KERNEL_MODULES[implementation])
            reason = module.unsupported_reason(x, w)
            if reason is not None:
                # A forced kernel says why it cannot; the default dispatch falls back.
                with pytest.raises(ValueError, match=re.escape(reason)):
                    grouped_matmul(x, w, sizes, implementation=implementation)
                implementation = None
        fn = jax.jit(functools.partial(grouped_matmul, swiglu=swiglu,
                                       implementation=implementation))
        y = fn(x, w, sizes)
    assert y.dtype == x.dtype and y.shape == (case.m, case.n // 2 if swiglu else case.n)
    return b, w, np.asarray(y.astype(jnp.float32), np.float64)


@pytest.mark.parametrize("implementation,platform", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_grouped_matmul_matches_oracle(name, implementation, platform):
    case = CASES[name]
    b, w, y = run(case, implementation, platform)
    want, allowance = oracle(case, b["x"], stored_weights(case, w), b["sizes"])
    err = np.abs(y - want)
    assert np.isfinite(y).all(), "non-finite outputs (unwritten rows?)"
    worst = np.unravel_index(np.argmax(err - allowance), err.shape)
    assert (err <= allowance).all(), f"max excess {np.max(err - allowance):.3g} at {worst}"


SWIGLU_CASES = ["bf16_decode", "bf16_m1", "bf16_random", "bf16_partial", "int8_decode"]


@pytest.mark.parametrize("implementation,platform", BACKENDS)
@pytest.mark.parametrize("name", SWIGLU_CASES)
def test_swiglu_matches_oracle(name, implementation, platform):
    """silu(gate) * up of the two halves of N, against the float64 oracle's product
    (`swiglu_oracle`)."""
    case = CASES[name]
    b, w, y = run(case, implementation, platform, swiglu=True)
    want, allowance = swiglu_oracle(
        case, *oracle(case, b["x"], stored_weights(case, w), b["sizes"]))
    assert np.isfinite(y).all(), "non-finite outputs (unwritten rows?)"
    assert (y[b["sizes"].sum():] == 0).all(), "rows past the groups must be zero"
    err = np.abs(y - want)
    worst = np.unravel_index(np.argmax(err - allowance), err.shape)
    assert (err <= allowance).all(), f"max excess {np.max(err - allowance):.3g} at {worst}"


def swiglu_oracle(case: Case, want, allowance):
    """The oracle's product [M, N] and allowance -> silu(gate) * up [M, N / 2] and its
    allowance: the halves' own through silu' <= 1.1 and the product, plus the output's
    rounding."""
    half = case.n // 2
    gate, up = want[:, :half], want[:, half:]
    a_gate, a_up = allowance[:, :half], allowance[:, half:]
    silu = gate / (1 + np.exp(-gate))
    want = silu * up
    allowance = 1.1 * np.abs(up) * a_gate + (np.abs(silu) + 1.1 * a_gate) * a_up
    if case.dtype != "float32":
        allowance += np.abs(want) * 2.0 ** -7
    return want, allowance


UNSORTED_CASES = ["bf16_decode", "bf16_m1", "bf16_random", "bf16_partial", "int8_decode"]


@pytest.mark.parametrize("implementation,platform", BACKENDS)
@pytest.mark.parametrize("name", UNSORTED_CASES)
def test_unsorted_rows_match_oracle(name, implementation, platform):
    """rows_sorted=False: a case's rows shuffled, each its own group span (as one decode
    token's k rows), rows of no group among them; each output row must be its own row's
    product (the Mosaic kernel walks the spans; the others, and the Mosaic item table for
    bf16_random's 100 rows, sort the rows first)."""
    case = CASES[name]
    b = build(case)
    rng = np.random.default_rng()
    perm = rng.permutation(case.m)
    group = np.repeat(np.arange(case.e + 1), np.append(b["sizes"], case.m - b["sizes"].sum()))
    rows = np.arange(case.m, dtype=np.int32)
    with jax.default_device(jax.devices(platform)[0]), jax.default_matmul_precision("highest"):
        w = quantize(b["w"], case.fmt) if case.fmt else jnp.asarray(b["w"], case.dtype)
        x = jnp.asarray(b["x"][perm], case.dtype)
        if implementation != "reference" and importlib.import_module(
                KERNEL_MODULES[implementation]).unsupported_reason(x, w) is not None:
            implementation = None  # the default dispatch falls back (see `run`)
        spans = RowGroups(jnp.asarray(group[perm], jnp.int32), jnp.asarray(rows),
                          jnp.asarray(rows + 1))
        y = jax.jit(functools.partial(grouped_matmul, rows_sorted=False,
                                      implementation=implementation))(
            x, w, jnp.asarray(b["sizes"]), row_groups=spans)
    y = np.asarray(y.astype(jnp.float32), np.float64)
    want, allowance = oracle(case, b["x"], stored_weights(case, w), b["sizes"])
    want, allowance = want[perm], allowance[perm]
    assert np.isfinite(y).all(), "non-finite outputs (unwritten rows?)"
    assert (y[group[perm] == case.e] == 0).all(), "rows of no group must be zero"
    err = np.abs(y - want)
    worst = np.unravel_index(np.argmax(err - allowance), err.shape)
    assert (err <= allowance).all(), f"max excess {np.max(err - allowance):.3g} at {worst}"
    with pytest.raises(ValueError, match="rows_sorted=False needs row_groups"):
        grouped_matmul(jnp.asarray(b["x"], case.dtype), w, jnp.asarray(b["sizes"]),
                       rows_sorted=False, implementation=implementation)


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("name", ["bf16_decode", "bf16_m1", "mxfp4_decode",
                                  "int4_g32_asym_decode"])
def test_few_unsorted_rows_reduce_by_row_on_the_gpu_default(name, swiglu, monkeypatch):
    """The Mosaic GPU default for up to ROW_REDUCE_MAX_M unsorted rows (one decode
    token's k rows) of float weights, or of quantized ones the kernel does not take:
    each row against its own group's weights (`grouped_matmul_rows`; quantized rows
    dequantised as gathered), not the kernel (patched here to fail), against the oracle;
    rows shuffled, rows of no group zero. The kernel still runs when forced."""
    import jaxinfer.ops.grouped_matmul as gm
    from jaxinfer.mosaic import grouped_matmul as mosaic_module

    def kernel_ran(*args, **kwargs):
        raise AssertionError("the Mosaic kernel ran")
    monkeypatch.setattr(gm, "default_implementation", lambda: "mosaic_gpu")
    monkeypatch.setattr(mosaic_module, "grouped_matmul_mgpu", kernel_ran)
    case = CASES[name]
    assert case.m <= gm.ROW_REDUCE_MAX_M
    b = build(case)
    rng = np.random.default_rng()
    perm = rng.permutation(case.m)
    group = np.repeat(np.arange(case.e + 1), np.append(b["sizes"], case.m - b["sizes"].sum()))
    group = group[perm]
    if case.m > 1:
        group[rng.integers(case.m)] = case.e  # a padding token's row, routed nowhere
    rows = jnp.arange(case.m, dtype=jnp.int32)
    with jax.default_matmul_precision("highest"):
        w = quantize(b["w"], case.fmt) if case.fmt else jnp.asarray(b["w"], case.dtype)
        x = jnp.asarray(b["x"][perm], case.dtype)
        spans = RowGroups(jnp.asarray(group, jnp.int32), rows, rows + 1)
        y = jax.jit(functools.partial(gm.grouped_matmul, rows_sorted=False, swiglu=swiglu))(
            x, w, jnp.asarray(b["sizes"]), row_groups=spans)
        with pytest.raises(AssertionError, match="the Mosaic kernel ran"):
            gm.grouped_matmul(x, w, jnp.asarray(b["sizes"]), row_groups=spans,
                              rows_sorted=False, implementation="mosaic_gpu")
    y = np.asarray(y.astype(jnp.float32), np.float64)
    want, allowance = oracle(case, b["x"], stored_weights(case, w), b["sizes"])
    if swiglu:
        want, allowance = swiglu_oracle(case, want, allowance)
    want, allowance = want[perm], allowance[perm]
    want[group == case.e] = 0.0
    assert y.shape == want.shape and np.isfinite(y).all()
    assert (y[group == case.e] == 0).all(), "rows of no group must be zero"
    err = np.abs(y - want)
    worst = np.unravel_index(np.argmax(err - allowance), err.shape)
    assert (err <= allowance).all(), f"max excess {np.max(err - allowance):.3g} at {worst}"


def test_few_unsorted_quantized_rows_the_kernel_takes_run_it(monkeypatch):
    """int8 / int4 experts at one decode token run the Mosaic kernel by default (faster
    than their rows there), not `grouped_matmul_rows`."""
    import jaxinfer.ops.grouped_matmul as gm
    from jaxinfer.mosaic import grouped_matmul as mosaic_module

    def kernel_ran(*args, **kwargs):
        raise AssertionError("the Mosaic kernel ran")
    monkeypatch.setattr(gm, "default_implementation", lambda: "mosaic_gpu")
    monkeypatch.setattr(mosaic_module, "grouped_matmul_mgpu", kernel_ran)
    monkeypatch.setattr(gm, "grouped_matmul_rows", lambda *a, **k: pytest.fail("rows ran"))
    case = CASES["int8_decode"]
    b = build(case)
    rows = jnp.arange(case.m, dtype=jnp.int32)
    spans = RowGroups(jnp.minimum(rows, case.e), rows, rows + 1)
    for fmt in ("int8", "int4:g128"):
        w = quantize(b["w"], fmt)
        with pytest.raises(AssertionError, match="the Mosaic kernel ran"):
            gm.grouped_matmul(jnp.asarray(b["x"], jnp.bfloat16), w, jnp.asarray(b["sizes"]),
                              row_groups=spans, rows_sorted=False)


@pytest.mark.parametrize("m,by_row", [(16, True), (40, False)])
def test_decode_rows_of_formats_the_kernel_dequantises_reduce_by_row(m, by_row, monkeypatch):
    """MXFP4 experts (which the Mosaic kernel would dequantise whole first) on the GPU
    default: up to min(E, QUANT_ROWS_MAX_M) rows given with their row groups (a decode
    step's; sorted here) reduce by row, matching the reference; more rows run the kernel
    (patched here to fail)."""
    import jaxinfer.ops.grouped_matmul as gm
    from jaxinfer.mosaic import grouped_matmul as mosaic_module

    def kernel_ran(*args, **kwargs):
        raise AssertionError("the Mosaic kernel ran")
    monkeypatch.setattr(gm, "default_implementation", lambda: "mosaic_gpu")
    monkeypatch.setattr(mosaic_module, "grouped_matmul_mgpu", kernel_ran)
    case = Case(m, 32, 128, 256, fmt="mxfp4")
    assert (m <= min(case.e, gm.QUANT_ROWS_MAX_M)) == by_row
    b = build(case)
    w = quantize(b["w"], case.fmt)
    x = jnp.asarray(b["x"], jnp.bfloat16)
    sizes = jnp.asarray(b["sizes"])
    spans = mosaic_module.build_row_items(sizes, m)
    if not by_row:
        with pytest.raises(AssertionError, match="the Mosaic kernel ran"):
            gm.grouped_matmul(x, w, sizes, row_groups=spans)
        return
    y = np.asarray(jax.jit(gm.grouped_matmul)(x, w, sizes, row_groups=spans)
                   .astype(jnp.float32), np.float64)
    want, allowance = oracle(case, b["x"], stored_weights(case, w), b["sizes"])
    assert np.isfinite(y).all()
    assert (np.abs(y - want) <= allowance).all()


def test_group_sizes_of_every_kind_are_drawn():
    """The case generator itself: empty experts, one expert, a short total."""
    rng = np.random.default_rng()
    from grouped_cases import group_sizes
    one = group_sizes(Case(30, 6, 128, 128, "one"), rng)
    assert sorted(one.tolist())[-1] == 30 and (one > 0).sum() == 1
    empty = group_sizes(Case(30, 6, 128, 128, "empty"), rng)
    assert empty.sum() == 30 and (empty == 0).sum() >= 3
    partial = group_sizes(Case(30, 6, 128, 128, "partial"), rng)
    assert partial.sum() < 30


def test_shape_errors_name_the_mismatch():
    x = jnp.ones((4, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="64 features, the weights 32"):
        grouped_matmul(x, jnp.ones((2, 16, 32), jnp.bfloat16), jnp.array([2, 2]))
    with pytest.raises(ValueError, match=r"group_sizes \(3,\), expected \(2,\)"):
        grouped_matmul(x, jnp.ones((2, 16, 64), jnp.bfloat16), jnp.array([2, 2, 0]))
