"""The linear op (`jaxinfer.ops.linear_registry.linear`): float weights through every
implementation the registry lists against a float64 oracle (the dot, the one-row
multiply-reduce, with a bias and a folded norm's row scale; the quantized kernels refuse
float weights), and the registry's picks on every platform (quantized weights' oracle
cases are in test_quantized_matmul.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops import platform as platform_module
from jaxinfer.ops.linear import LinearCall
from jaxinfer.ops.linear_registry import (
    MAX_KERNEL_M,
    ONE_ROW_REDUCE_MIN_K,
    REGISTRY,
    linear,
)
from jaxinfer.ops.quant import VALUE_DTYPES, QuantizedWeight, parse_format

# The implementations that take float weights; the others take only QuantizedWeights.
FLOAT_IMPLEMENTATIONS = ("one_row_reduce", "reference", "fixed_rows")
QUANTIZED_IMPLEMENTATIONS = ("mosaic_gpu", "pallas_tpu", "w8a8_gpu", "mosaic_fp8_blocks")


def test_every_implementation_is_tested():
    assert set(REGISTRY.names) == {*FLOAT_IMPLEMENTATIONS, *QUANTIZED_IMPLEMENTATIONS}


@pytest.mark.parametrize("implementation", [None, *REGISTRY.names])
@pytest.mark.parametrize("rows,k", [(1, ONE_ROW_REDUCE_MIN_K + 64), (1, 576), (3, 1088)])
@pytest.mark.parametrize("extras", [False, True], ids=["plain", "bias+row_scale"])
def test_linear_matches_oracle(rows, k, extras, implementation):
    rng = np.random.default_rng()
    n = 96
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.float32)  # cast to bf16 inside
    bias = jnp.asarray(rng.standard_normal(n), jnp.float32) if extras else None
    scale = jnp.asarray(np.exp(rng.standard_normal((rows, 1))), jnp.float32) if extras \
        else None
    if implementation in QUANTIZED_IMPLEMENTATIONS:
        with pytest.raises(ValueError, match="takes a QuantizedWeight"):
            linear(x, w, bias, scale, implementation=implementation)
        return
    fn = jax.jit(lambda x, w, b, s: linear(x, w, b, s, implementation=implementation))
    y = fn(x, w, bias, scale)
    assert y.dtype == jnp.bfloat16 and y.shape == (rows, n)
    x64 = np.asarray(x, np.float64)
    w64 = np.asarray(w.astype(jnp.bfloat16), np.float64)
    want = x64 @ w64.T
    mag = np.abs(x64) @ np.abs(w64).T
    if extras:
        want = want * np.asarray(scale, np.float64) + np.asarray(bias, np.float64)
        mag = mag * np.asarray(scale, np.float64) + np.abs(np.asarray(bias, np.float64))
    # float32 accumulation, at most two bf16 roundings (the product, then the output)
    allowance = 2 * 2.0 ** -8 * mag + 1e-6
    np.testing.assert_array_less(np.abs(np.asarray(y, np.float64) - want), allowance)
    # The one-row form is the multiply-reduce; the reference is a dot; the default (on the
    # CPU) takes the one-row form for one row of K >= ONE_ROW_REDUCE_MIN_K.
    jaxpr = str(jax.make_jaxpr(lambda x, w: linear(x, w, implementation=implementation))(x, w))
    one_row = rows == 1 and k >= ONE_ROW_REDUCE_MIN_K if implementation is None \
        else implementation == "one_row_reduce"
    assert ("dot_general" in jaxpr) == (not one_row)


@pytest.mark.parametrize("implementation", [None, *REGISTRY.names])
@pytest.mark.parametrize("rows,k", [(1, ONE_ROW_REDUCE_MIN_K + 64), (3, 576)])
def test_swiglu_prologue_matches_oracle(rows, k, implementation):
    """prologue="swiglu": x [M, 2K] holds gate | up, the product takes silu(gate) * up
    (float32, rounded to x.dtype once), whether the implementation applies it itself
    (`fuses`) or `linear` does before it."""
    rng = np.random.default_rng()
    n = 64
    x = jnp.asarray(rng.standard_normal((rows, 2 * k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.bfloat16)
    if implementation in QUANTIZED_IMPLEMENTATIONS:
        with pytest.raises(ValueError, match="takes a QuantizedWeight"):
            linear(x, w, prologue="swiglu", implementation=implementation)
        return
    y = jax.jit(lambda x, w: linear(x, w, prologue="swiglu",
                                    implementation=implementation))(x, w)
    assert y.dtype == jnp.bfloat16 and y.shape == (rows, n)
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    gate, up = x64[:, :k], x64[:, k:]
    h = gate / (1 + np.exp(-gate)) * up
    mag = np.abs(h) @ np.abs(w64).T
    # h rounded to bf16, then as the plain product: float32 sums, two bf16 roundings
    np.testing.assert_array_less(np.abs(np.asarray(y, np.float64) - h @ w64.T),
                                 3 * 2.0 ** -8 * mag + 1e-6)


def test_swiglu_prologue_checks_its_halves():
    with pytest.raises(ValueError, match=r"x has 510 features \(the SwiGLU's two halves\), "
                                         "the weight 256"):
        linear(jnp.ones((1, 510), jnp.bfloat16), jnp.ones((8, 256), jnp.bfloat16),
               prologue="swiglu")
    with pytest.raises(ValueError, match="prologue 'gelu' is not one of"):
        linear(jnp.ones((1, 512), jnp.bfloat16), jnp.ones((8, 256), jnp.bfloat16),
               prologue="gelu")


def test_feature_mismatch_is_named():
    with pytest.raises(ValueError, match="x has 255 features, the weight 256"):
        linear(jnp.ones((1, 255), jnp.bfloat16), jnp.ones((8, 256), jnp.bfloat16))


def described(rows: int, n: int, k: int, fmt: str | None, dtype=jnp.bfloat16) -> LinearCall:
    """The call linear(x [rows, K], W [N, K]) makes, W float (fmt None) or quantized as fmt
    (described: shapes and dtypes only)."""
    x = jax.ShapeDtypeStruct((rows, k), dtype)
    if fmt is None:
        return LinearCall.describe(x, jax.ShapeDtypeStruct((n, k), jnp.bfloat16))
    f = parse_format(fmt)
    g = f.group_size or k
    scales = jax.ShapeDtypeStruct((k // g, n), jnp.float32)
    w = QuantizedWeight(jax.ShapeDtypeStruct((n, k), VALUE_DTYPES[f.kind]), scales,
                        scales if f.asymmetric else None, f.activations)
    return LinearCall.describe(x, w)


BIG_K = ONE_ROW_REDUCE_MIN_K
# (call, {platform: the implementation picked}); platforms not named pick the reference.
PICKS = [
    # Float weights: the one-row reduction on every platform, else XLA's dot.
    (described(1, 256, BIG_K, None), dict(cpu="one_row_reduce", gpu="one_row_reduce",
                                          hopper="one_row_reduce", tpu="one_row_reduce")),
    (described(1, 256, BIG_K - 64, None), {}),
    (described(2, 256, BIG_K, None), {}),
    # int8 / int4: the Mosaic kernel on Hopper up to MAX_KERNEL_M rows, the TPU kernel.
    (described(1, 256, 512, "int8"), dict(hopper="mosaic_gpu", tpu="pallas_tpu")),
    (described(MAX_KERNEL_M, 256, 512, "int4:g128"),
     dict(hopper="mosaic_gpu", tpu="pallas_tpu")),
    (described(MAX_KERNEL_M + 1, 256, 512, "int8"), dict(tpu="pallas_tpu")),
    # W8A8 on Hopper, at any number of rows: per channel the one-pass activation
    # quantization and XLA's fp8 dot, group-wise the Mosaic fp8 kernel.
    (described(1, 256, 512, "fp8"), dict(hopper="w8a8_gpu", tpu="pallas_tpu")),
    (described(300, 256, 512, "fp8"), dict(hopper="w8a8_gpu", tpu="pallas_tpu")),
    # (The TPU kernel's W8A8 takes per-channel scales only.)
    (described(3, 256, 512, "fp8:g128"), dict(hopper="mosaic_fp8_blocks")),
    (described(3, 192, 512, "fp8:g128"), {}),  # N: not whole 128-column tiles
    (described(3, 256, 512, "fp8:weight-only"), dict(tpu="pallas_tpu")),
    # Formats the Mosaic kernels do not take, or shapes they cannot tile.
    # fp4 (MXFP4 / NVFP4): the Mosaic kernel reads its codes as words.
    (described(1, 256, 512, "nvfp4"), dict(hopper="mosaic_gpu", tpu="pallas_tpu")),
    (described(MAX_KERNEL_M, 256, 512, "mxfp4"), dict(hopper="mosaic_gpu", tpu="pallas_tpu")),
    (described(1, 96, 512, "int8"), {}),  # N: neither kernel's multiple
    (described(1, 256, 512, "int8", jnp.float32), {}),  # float32 activations
]


@pytest.mark.parametrize("platform", ["cpu", "gpu", "hopper", "tpu"])
@pytest.mark.parametrize("case", range(len(PICKS)))
def test_registry_picks(monkeypatch, platform, case):
    call, picks = PICKS[case]
    monkeypatch.setattr(platform_module, "platform", lambda: platform)
    reasons = REGISTRY.reasons(call)
    want = picks.get(platform, "reference")
    assert REGISTRY.pick(call).name == want, reasons
    assert reasons[want] is None
    # Everything preferred to the pick says why not; a forced name is taken as it is.
    for name in REGISTRY.names[:REGISTRY.names.index(want)]:
        assert reasons[name], name
    assert REGISTRY.pick(call, "reference").name == "reference"


def test_reasons_name_the_rule(monkeypatch):
    monkeypatch.setattr(platform_module, "platform", lambda: "hopper")
    reasons = REGISTRY.reasons(described(MAX_KERNEL_M + 1, 256, 512, "int8"))
    assert "MAX_KERNEL_M" in reasons["mosaic_gpu"]
    reasons = REGISTRY.reasons(described(1, 256, BIG_K - 64, None))
    assert "ONE_ROW_REDUCE_MIN_K" in reasons["one_row_reduce"]
    assert "fp8" in REGISTRY.reasons(described(1, 256, 512, "fp8"))["mosaic_gpu"]
    with pytest.raises(ValueError, match="expected one of"):
        REGISTRY.pick(described(1, 256, 512, None), "no_such_implementation")


@pytest.mark.parametrize("implementation", ["reference", "fixed_rows"])
def test_rounded_product_comes_from_the_dot(implementation):
    """`rounded=True` (a product a kernel reads) asks the dot itself for x.dtype, where the
    default leaves a float32 product for XLA to fuse its cast into what reads it: the same
    values (one rounding of the float32 sum either way)."""
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((24, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((96, 256)) * 0.05, jnp.bfloat16)
    for rounded, want, other in ((True, "bfloat16", "float32"), (False, "float32", "bfloat16")):
        jaxpr = str(jax.make_jaxpr(lambda x, w, r=rounded: linear(
            x, w, rounded=r, implementation=implementation))(x, w))
        assert f"preferred_element_type={want}" in jaxpr
        assert f"preferred_element_type={other}" not in jaxpr
    got = jax.jit(lambda x, w: linear(x, w, rounded=True, implementation=implementation))(x, w)
    base = jax.jit(lambda x, w: linear(x, w, implementation=implementation))(x, w)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(base, np.float32))
