"""Every implementation the grouped matmul's registry lists
(`jaxinfer.ops.grouped_matmul_registry`) against an independent float64 oracle (cases in
grouped_cases.py): random group sizes, empty experts, all rows on one expert, rows past
the groups' total, float and quantized expert weights; and the registry's picks.

Kernels run in interpret mode on the CPU (Mosaic GPU: uninitialised memory reads as
NaN, so an unwritten output element fails) and natively under `pytest -m gpu`.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from grouped_cases import CASES, Case, build, oracle, stored_weights

from jaxinfer.mosaic import grouped_matmul as mosaic_gpu_kernel
from jaxinfer.ops import platform as platform_module
from jaxinfer.ops.grouped_matmul import GroupedMatmulCall, RowGroups
from jaxinfer.ops.grouped_matmul_registry import (
    QUANT_ROWS_MAX_M,
    REGISTRY,
    ROW_REDUCE_MAX_M,
    grouped_matmul,
)
from jaxinfer.ops.quant import VALUE_DTYPES, QuantizedWeight, parse_format, quantize
from jaxinfer.pallas_kernels import grouped_matmul as pallas_tpu_kernel

gpu = pytest.mark.gpu
# (implementation, platform): every implementation the registry lists, kernels in
# interpret mode on the CPU.
BACKENDS = [
    *((name, "cpu") for name in REGISTRY.names),
    pytest.param("reference", "gpu", marks=gpu), pytest.param("mosaic_gpu", "gpu", marks=gpu),
]
KERNELS = {"mosaic_gpu": mosaic_gpu_kernel, "pallas_tpu": pallas_tpu_kernel}


def test_every_implementation_is_tested():
    assert set(REGISTRY.names) == {"row_reduce", "reference", "rows_fixed_blocks", *KERNELS}


def refusal(implementation: str, x, w) -> str | None:
    """Why `implementation`, forced, refuses these inputs (it raises ValueError saying so),
    or None (the row reduction takes any call that gives row_groups)."""
    module = KERNELS.get(implementation)
    return None if module is None else module.unsupported_reason(x, w)


def sorted_row_groups(sizes: np.ndarray, m: int) -> RowGroups:
    """Each of m rows in group order: its group (E past the groups' total) and its group's
    span."""
    ends = np.cumsum(sizes)
    group = np.repeat(np.arange(len(sizes) + 1), np.append(sizes, m - ends[-1]))
    start = np.append(ends - sizes, ends[-1])[group]
    end = np.append(ends, m)[group]
    return RowGroups(*(jnp.asarray(a, jnp.int32) for a in (group, start, end)))


def run(case: Case, implementation: str, platform: str, swiglu: bool = False):
    """(inputs, weights, y as float64) of the case through `implementation`; None where it
    refuses them (after checking that it says so) and runs on the CPU. On the GPU a
    refused case runs the registry's pick instead."""
    b = build(case)
    with jax.default_device(jax.devices(platform)[0]), jax.default_matmul_precision("highest"):
        w = (quantize(b["w"], case.fmt) if case.fmt
             else jnp.asarray(b["w"], case.dtype))
        x = jnp.asarray(b["x"], case.dtype)
        sizes = jnp.asarray(b["sizes"])
        # The row reduction needs each row's group, which sorted rows give.
        kwargs = (dict(row_groups=sorted_row_groups(b["sizes"], case.m))
                  if implementation == "row_reduce" else {})
        if (reason := refusal(implementation, x, w)) is not None:
            with pytest.raises(ValueError, match=re.escape(reason)):
                grouped_matmul(x, w, sizes, implementation=implementation)
            if platform == "cpu":  # the pick there is the reference, tested on its own
                return None
            implementation = None
        fn = jax.jit(functools.partial(grouped_matmul, swiglu=swiglu,
                                       implementation=implementation))
        y = fn(x, w, sizes, **kwargs)
    assert y.dtype == x.dtype and y.shape == (case.m, case.n // 2 if swiglu else case.n)
    return b, w, np.asarray(y.astype(jnp.float32), np.float64)


@pytest.mark.parametrize("implementation,platform", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_grouped_matmul_matches_oracle(name, implementation, platform):
    case = CASES[name]
    if (result := run(case, implementation, platform)) is None:
        return
    b, w, y = result
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
    if (result := run(case, implementation, platform, swiglu=True)) is None:
        return
    b, w, y = result
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
        if refusal(implementation, x, w) is not None:
            if platform == "cpu":  # (the sorted case checks that it says so)
                return
            implementation = None
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


def test_row_reduce_needs_row_groups():
    x = jnp.ones((4, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="row_reduce: needs row_groups"):
        grouped_matmul(x, jnp.ones((2, 128, 256), jnp.bfloat16), jnp.array([2, 2]),
                       implementation="row_reduce")


def described(m: int, e: int, fmt: str | None = None, *, row_groups: bool = True,
              rows_sorted: bool = True, dtype=jnp.bfloat16, n: int = 256,
              k: int = 256) -> GroupedMatmulCall:
    """The call grouped_matmul(x [m, K], W [e, N, K], ...) makes, W float in x's dtype (fmt
    None) or quantized as fmt (described: shapes and dtypes only)."""
    x = jax.ShapeDtypeStruct((m, k), dtype)
    if fmt is None:
        w = jax.ShapeDtypeStruct((e, n, k), dtype)
    else:
        f = parse_format(fmt)
        g = f.group_size or k
        scales = jax.ShapeDtypeStruct((e, k // g, n), jnp.float32)
        w = QuantizedWeight(jax.ShapeDtypeStruct((e, n, k), VALUE_DTYPES[f.kind]), scales,
                            scales if f.asymmetric else None, f.activations)
    groups = RowGroups(*[jax.ShapeDtypeStruct((m,), jnp.int32)] * 3) if row_groups else None
    return GroupedMatmulCall.describe(x, w, row_groups=groups, rows_sorted=rows_sorted)


# (call, the pick on Hopper, on TPU); CPUs and other GPUs pick the reference.
PICKS = [
    # One decode token's rows of float weights (unsorted, with their groups): by row.
    (described(ROW_REDUCE_MAX_M, 8, rows_sorted=False), "row_reduce", "pallas_tpu"),
    (described(1, 4, rows_sorted=False), "row_reduce", "pallas_tpu"),
    (described(ROW_REDUCE_MAX_M + 1, 16, rows_sorted=False), "mosaic_gpu", "pallas_tpu"),
    (described(8, 8), "mosaic_gpu", "pallas_tpu"),  # sorted float rows
    (described(8, 8, row_groups=False), "mosaic_gpu", "pallas_tpu"),
    # Decode rows of formats the Mosaic kernel would dequantise whole (zero points, groups
    # of 32, fp8, fp4 against f16 rows), up to min(E, QUANT_ROWS_MAX_M) rows, sorted or
    # not: by row.
    (described(16, 32, "int8:g32"), "row_reduce", "pallas_tpu"),
    (described(33, 32, "int8:g32"), "mosaic_gpu", "pallas_tpu"),
    (described(16, 32, "int8:g32", row_groups=False), "mosaic_gpu", "pallas_tpu"),
    (described(16, 32, "mxfp4", dtype=jnp.float16), "row_reduce", "pallas_tpu"),
    (described(QUANT_ROWS_MAX_M, 256, "fp8:weight-only"), "row_reduce", "pallas_tpu"),
    (described(QUANT_ROWS_MAX_M + 8, 256, "fp8:weight-only"), "mosaic_gpu", "pallas_tpu"),
    (described(8, 8, "int4:g32:asym", rows_sorted=False), "row_reduce", "pallas_tpu"),
    # int8 / int4 / fp4 experts the kernel upcasts in registers: the kernel, even at one
    # token.
    (described(8, 8, "int8", rows_sorted=False), "mosaic_gpu", "pallas_tpu"),
    (described(4, 32, "mxfp4", rows_sorted=False), "mosaic_gpu", "pallas_tpu"),
    (described(16, 32, "nvfp4"), "mosaic_gpu", "pallas_tpu"),
    (described(1, 8, "int4:g128", rows_sorted=False), "mosaic_gpu", "pallas_tpu"),
    # Inputs the kernels do not take: float32 rows (Mosaic), N not a multiple of 128 (TPU).
    (described(40, 4, dtype=jnp.float32), "reference", "pallas_tpu"),
    (described(40, 4, n=192), "mosaic_gpu", "reference"),
]


@pytest.mark.parametrize("platform", ["cpu", "gpu", "hopper", "tpu"])
@pytest.mark.parametrize("case", range(len(PICKS)))
def test_registry_picks(monkeypatch, platform, case):
    call, on_hopper, on_tpu = PICKS[case]
    monkeypatch.setattr(platform_module, "platform", lambda: platform)
    reasons = REGISTRY.reasons(call)
    want = dict(hopper=on_hopper, tpu=on_tpu).get(platform, "reference")
    assert REGISTRY.pick(call).name == want, reasons
    # Everything preferred to the pick says why not; a forced name is taken as it is.
    for name in REGISTRY.names[:REGISTRY.names.index(want)]:
        assert reasons[name], name
    assert REGISTRY.pick(call, "mosaic_gpu").name == "mosaic_gpu"


def test_row_reduce_reasons_name_the_rule(monkeypatch):
    monkeypatch.setattr(platform_module, "platform", lambda: "hopper")
    reasons = REGISTRY.reasons(described(ROW_REDUCE_MAX_M + 1, 16, rows_sorted=False))
    assert "ROW_REDUCE_MAX_M" in reasons["row_reduce"]
    assert "QUANT_ROWS_MAX_M" in REGISTRY.reasons(described(33, 32, "int8:g32"))["row_reduce"]
    assert "upcasts" in REGISTRY.reasons(described(8, 8, "int8"))["row_reduce"]


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
