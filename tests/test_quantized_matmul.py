"""Quantized weights: quantise-dequantise bounds per format, and every implementation of
the linear op (`jaxinfer.ops.linear_registry`) on quantized weights against an independent
float64 oracle (cases in quant_cases.py).

Kernels run in interpret mode on the CPU (Mosaic GPU: uninitialised memory reads
as NaN, so an unwritten output element fails) and natively under `pytest -m gpu`.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from quant_cases import CASES, Case, build, oracle, stored_weight

from jaxinfer.errors import JaxinferError
from jaxinfer.mosaic import fp8_blocks_matmul as fp8_blocks_kernel
from jaxinfer.mosaic import quantized_matmul as mosaic_gpu_kernel
from jaxinfer.ops.linear_registry import REGISTRY, linear
from jaxinfer.ops.quant import QuantizedWeight, dequantize, error_bound, parse_format, quantize
from jaxinfer.pallas_kernels import quantized_matmul as pallas_tpu_kernel

gpu = pytest.mark.gpu
# (implementation, platform): every implementation the registry lists, kernels in
# interpret mode on the CPU.
BACKENDS = [
    *((name, "cpu") for name in REGISTRY.names),
    pytest.param("reference", "gpu", marks=gpu), pytest.param("mosaic_gpu", "gpu", marks=gpu),
    pytest.param("w8a8_gpu", "gpu", marks=gpu), pytest.param("mosaic_fp8_blocks", "gpu", marks=gpu),
]
KERNELS = {"mosaic_gpu": mosaic_gpu_kernel, "pallas_tpu": pallas_tpu_kernel}


def refusal(implementation: str, x, qw) -> str | None:
    """Why `implementation`, forced, refuses these inputs (it raises ValueError saying so),
    or None."""
    if implementation == "one_row_reduce":
        return "takes float weights"
    if implementation in ("reference", "fixed_rows"):
        return None
    if implementation == "w8a8_gpu":
        return None if qw.activations == "fp8" else "takes a QuantizedWeight with fp8 activations"
    if implementation == "mosaic_fp8_blocks":
        if qw.activations != "fp8":
            return "takes a QuantizedWeight with fp8 activations"
        return fp8_blocks_kernel.unsupported_reason(jnp.zeros(x.shape, jnp.float8_e4m3fn), qw)
    return KERNELS[implementation].unsupported_reason(x, qw)


def test_every_implementation_is_tested():
    assert set(REGISTRY.names) == {"one_row_reduce", "reference", "fixed_rows", "w8a8_gpu",
                                   "mosaic_fp8_blocks", *KERNELS}


def run(case: Case, implementation: str, platform: str):
    """(inputs, weight, y as float64) of the case through `implementation`; None where it
    refuses them (after checking that it says so) and runs on the CPU. On the GPU a
    refused case runs the registry's pick instead."""
    b = build(case)
    with jax.default_device(jax.devices(platform)[0]), jax.default_matmul_precision("highest"):
        qw = quantize(b["w"], case.fmt)
        x = jnp.asarray(b["x"], case.dtype)
        reason = refusal(implementation, x, qw)
        if reason is not None:
            with pytest.raises(ValueError, match=re.escape(reason)):
                linear(x, qw, implementation=implementation)
            if platform == "cpu":  # the pick there is the reference, tested on its own
                return None
            implementation = None
        fn = jax.jit(functools.partial(linear, implementation=implementation))
        y = fn(x, qw)
    assert y.dtype == x.dtype and y.shape == (case.m, case.n)
    return b, qw, np.asarray(y.astype(jnp.float32), np.float64)


@pytest.mark.parametrize("implementation,platform", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_oracle(name, implementation, platform):
    case = CASES[name]
    if (result := run(case, implementation, platform)) is None:
        return
    b, qw, y = result
    assert np.isfinite(y).all(), f"non-finite outputs at {np.argwhere(~np.isfinite(y))[:5]}"
    want, allowance = oracle(case, b["x"], qw)
    err = np.abs(y - want)
    worst = np.unravel_index(np.argmax(err - allowance), err.shape)
    assert (err <= allowance).all(), (
        f"{name}/{implementation}: |y - oracle| = {err[worst]:.3g} > {allowance[worst]:.3g} "
        f"at {worst} (y={y[worst]:.5g}, oracle={want[worst]:.5g})")


@pytest.mark.parametrize("fmt", ["int8", "int8:g32", "int8:g128:asym", "int4", "int4:g64",
                                 "int4:g128", "int4:g32:asym", "fp8", "fp8:weight-only",
                                 "fp8:g128:weight-only", "mxfp4", "nvfp4"])
def test_quantize_dequantize_error_bound(fmt):
    w = build(Case(fmt, 1, 128, 512, outliers=True, seed=7))["w"]
    qw = quantize(w, fmt)
    f = parse_format(fmt)
    n, k = w.shape
    g = f.group_size or k
    assert qw.values.dtype == {"int8": jnp.int8, "int4": jnp.int4, "fp8": jnp.float8_e4m3fn,
                               "fp4": jnp.float4_e2m1fn}[f.kind]
    assert qw.values.shape == (n, k) and qw.scales.shape == (k // g, n)
    assert qw.scales.dtype == jnp.float32 and qw.group_size == g
    assert (qw.offsets is not None) == f.asymmetric
    err = np.abs(np.asarray(dequantize(qw)) - w)
    # (plus float32 rounding of the dequantised value itself)
    bound = np.asarray(error_bound(qw)) + 2.0 ** -20 * np.abs(w) + 1e-9
    assert (err <= bound).all(), f"{fmt}: max excess {np.max(err - bound):.3g}"
    # dequantize agrees with the oracle's reading of the stored parts.
    np.testing.assert_allclose(np.asarray(dequantize(qw)), stored_weight(qw), rtol=1e-6,
                               atol=1e-6 * np.abs(w).max())  # offset + q * scale cancels
    # Integer formats use their range: the largest |value| in each group hits qmax.
    if f.kind in ("int8", "int4") and not f.asymmetric:
        qmax = {"int8": 127, "int4": 7}[f.kind]
        v = np.abs(np.asarray(qw.values.astype(jnp.int8))).reshape(n, k // g, g)
        assert (v.max(axis=-1) == qmax).all()


@pytest.mark.parametrize("magnitude", [0.05, 3e4])
def test_nvfp4_scales_are_e4m3_times_a_power_of_two(magnitude):
    w = build(Case("nvfp4", 1, 128, 256, outliers=True, seed=3))["w"] * magnitude
    w[5, :16] = 0  # an all-zero group
    w[6, 16:32] *= 1e-7  # a group far below the tensor's largest: e4m3's subnormal scales
    qw = quantize(w, "nvfp4")
    s = np.asarray(qw.scales, np.float64)
    assert qw.group_size == 16 and str(parse_format("nvfp4")) == "nvfp4"
    t = 2.0 ** np.ceil(np.log2(s.max() / 448))  # the tensor's scale, a power of two
    b = s / t
    assert 224 < b.max() <= 448
    np.testing.assert_array_equal(b.astype(ml_dtypes.float8_e4m3fn).astype(np.float64), b)
    v = np.abs(np.asarray(qw.values.astype(jnp.float32))).reshape(128, 16, 16)
    live = np.abs(w).reshape(128, 16, 16).max(axis=-1) > 0
    # Scales rounded up: no value past e2m1's 6; each group's largest at 4 or more where
    # its scale is a normal e4m3 number (its absmax / scale is then above 6 / 1.125).
    assert v.max() <= 6 and (v.max(axis=-1)[live & (b.T >= 2.0 ** -6)] >= 4).all()
    np.testing.assert_array_equal(np.asarray(dequantize(qw))[5, :16], 0)
    assert np.isfinite(s).all() and (s > 0).all()
    # The scale search never does worse than the smallest e4m3 scale that clips nothing
    # (found here from the table of every e4m3 number), group by group.
    e4m3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    e4m3 = np.unique(e4m3[np.isfinite(e4m3) & (e4m3 > 0)])
    groups = w.astype(np.float64).reshape(128, 16, 16)
    need = np.abs(groups).max(axis=-1) / (6 * t)
    no_clip = e4m3[np.minimum(np.searchsorted(e4m3, need), len(e4m3) - 1)] * t

    def squared_error(scale):
        v = np.clip(groups / scale[..., None], -6, 6).astype(ml_dtypes.float4_e2m1fn)
        return np.square(v.astype(np.float64) * scale[..., None] - groups).sum(-1)

    chosen = squared_error(s.T)
    assert (chosen <= squared_error(no_clip) * (1 + 1e-6) + 1e-30).all()
    assert (chosen < squared_error(no_clip)).any()  # and it finds better scales


def test_mxfp4_scales_are_powers_of_two_of_least_error():
    w = build(Case("mxfp4", 1, 128, 256, outliers=True, seed=4))["w"]
    w[5, :32] = 0  # an all-zero group
    qw = quantize(w, "mxfp4")
    s = np.asarray(qw.scales, np.float64).T  # [N, K // 32]
    np.testing.assert_array_equal(np.exp2(np.round(np.log2(s))), s)
    groups = w.astype(np.float64).reshape(128, 8, 32)
    absmax = np.abs(groups).max(axis=-1)
    no_clip = np.where(absmax > 0, np.exp2(np.ceil(np.log2(np.maximum(absmax, 1e-30) / 6))), 1.0)
    # Each scale is the no-clipping power of two or the one below it (when that clips only
    # up to 7.5 / 6 of the range), whichever gives the smaller squared error.
    assert ((s == no_clip) | ((s == no_clip / 2) & (absmax / s <= 7.5))).all()

    def squared_error(scale):
        v = np.clip(groups / scale[..., None], -6, 6).astype(ml_dtypes.float4_e2m1fn)
        return np.square(v.astype(np.float64) * scale[..., None] - groups).sum(-1)

    assert (squared_error(s) <= squared_error(no_clip) * (1 + 1e-6) + 1e-30).all()
    assert (s < no_clip).any()
    np.testing.assert_array_equal(np.asarray(dequantize(qw))[5, :32], 0)


def test_quantize_all_zero_rows_and_int4_packing():
    w = np.zeros((128, 256), np.float32)
    w[1] = np.linspace(-1, 1, 256)
    qw = quantize(w, "int4:g64")
    assert np.isfinite(np.asarray(qw.scales)).all()
    np.testing.assert_array_equal(np.asarray(dequantize(qw))[0], 0)
    # int4 values occupy half a byte each on the device (two per byte).
    assert qw.nbytes == 128 * 256 // 2 + qw.scales.size * 4


@pytest.mark.parametrize("spec,message", [
    ("int3", "unknown format 'int3'"),
    ("int4:g100", "group size 100"),
    ("int8:weird", "unknown option 'weird'"),
    ("nvfp4:g32", "nvfp4 takes no options"),
    ("mxfp4:asym", "mxfp4 takes no options"),
])
def test_bad_format_strings(spec, message):
    with pytest.raises(JaxinferError, match=message):
        parse_format(spec)


def test_group_must_divide_k():
    with pytest.raises(JaxinferError, match="in_features 200 is not a multiple of it"):
        quantize(np.ones((128, 200), np.float32), "int4:g128")


def test_leading_dims_and_feature_check():
    qw = quantize(build(Case("int8", 1, 128, 256))["w"], "int8")
    x = jnp.ones((2, 3, 256), jnp.bfloat16)
    assert linear(x, qw, implementation="reference").shape == (2, 3, 128)
    with pytest.raises(ValueError, match="x has 255 features, the weight 256"):
        linear(jnp.ones((1, 255), jnp.bfloat16), qw)


@pytest.mark.parametrize("platform", ["cpu", pytest.param("gpu", marks=gpu)])
@pytest.mark.parametrize("dtype,m,k", [("bfloat16", 6, 1000), ("float32", 3, 4096)])
def test_fp8_row_quantization(dtype, m, k, platform):
    """W8A8's per-token quantization, the reference and the GPU kernel (interpret mode on
    the CPU), against a float64 oracle: per row scale = max |x| / 448 (to float32's
    rounding; the kernel's division to 2 ulp), values x / scale rounded to e4m3's nearest
    even, one e4m3 step apart only where x / scale lies within float32 rounding of a tie.
    Rows span 2^-20..2^20, with a zero row and an outlier."""
    from jaxinfer.ops.linear import quantize_activations_fp8
    from jaxinfer.pallas_kernels.fp8_rows_gpu import quantize_rows_fp8_gpu

    rng = np.random.default_rng()
    x = rng.standard_normal((m, k)) * 2.0 ** rng.uniform(-20, 20, (m, 1))
    x[1] = 0.0
    x[0, rng.integers(k)] = np.abs(x[0]).max() * 37.0
    x = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)  # as stored
    absmax = np.abs(x).max(axis=1, keepdims=True)
    want_scales = np.where(absmax > 0, absmax / 448.0, 1.0)
    with jax.default_device(jax.devices(platform)[0]):
        xj = jnp.asarray(x, dtype)
        for quantize in (quantize_activations_fp8, quantize_rows_fp8_gpu):
            values, scales = jax.jit(quantize)(xj)
            assert values.dtype == jnp.float8_e4m3fn and values.shape == (m, k)
            scales = np.asarray(scales, np.float64)
            np.testing.assert_allclose(scales, want_scales, rtol=2.0 ** -21)
            t = x / scales  # exact in float64: what the values round
            want = t.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
            got = np.asarray(values).astype(np.float64)
            step = np.where(np.abs(t) >= 2.0 ** -6, 2.0 ** (
                np.floor(np.log2(np.maximum(np.abs(t), 1e-30))) - 3), 2.0 ** -9)
            frac = np.abs(t) / step - np.floor(np.abs(t) / step)
            near_tie = np.abs(frac - 0.5) * step < np.abs(t) * 2.0 ** -21
            bad = (got != want) & ~(near_tie & (np.abs(got - want) <= step))
            assert not bad.any(), (f"{quantize.__name__}: {bad.sum()} values off, first at "
                                   f"{np.argwhere(bad)[:3].tolist()}")


@pytest.mark.parametrize("platform", ["cpu", pytest.param("gpu", marks=gpu)])
@pytest.mark.parametrize("dtype,m,k", [("bfloat16", 5, 1000), ("float32", 3, 640)])
def test_fp8_row_quantization_swiglu(dtype, m, k, platform):
    """W8A8's quantization with the SwiGLU prologue (x [M, 2K] = gate | up), the reference
    (`swiglu_halves` then `quantize_activations_fp8`) and the GPU kernel that reads both
    halves in its one pass, against a float64 oracle of silu(gate) * up: each row's scale
    its max / 448 and each value within one e4m3 step (the halves' product is rounded to
    x's dtype first, so a value near a tie may round either way). Swapped halves, a wrong
    offset to up, or no SwiGLU at all break it by far more."""
    from jaxinfer.ops.linear import quantize_activations_fp8, swiglu_halves
    from jaxinfer.pallas_kernels.fp8_rows_gpu import quantize_rows_fp8_gpu

    rng = np.random.default_rng()
    x = rng.standard_normal((m, 2 * k)) * 2.0 ** rng.uniform(-4, 4, (m, 1))
    x = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)  # as stored
    gate, up = x[:, :k], x[:, k:]
    h = gate / (1 + np.exp(-gate)) * up
    want_scales = np.abs(h).max(axis=1, keepdims=True) / 448.0
    steps = np.where(np.abs(h / want_scales) >= 2.0 ** -6, 2.0 ** (np.floor(np.log2(
        np.maximum(np.abs(h / want_scales), 1e-30))) - 3), 2.0 ** -9) * want_scales
    fns = {"reference": lambda x: quantize_activations_fp8(swiglu_halves(x, x.dtype)),
           "kernel": lambda x: quantize_rows_fp8_gpu(x, swiglu=True)}
    with jax.default_device(jax.devices(platform)[0]):
        for name, fn in fns.items():
            values, scales = jax.jit(fn)(jnp.asarray(x, dtype))
            assert values.dtype == jnp.float8_e4m3fn and values.shape == (m, k), name
            scales = np.asarray(scales, np.float64)
            np.testing.assert_allclose(scales, want_scales, rtol=2.0 ** -7, err_msg=name)
            got = np.asarray(values).astype(np.float64) * scales
            bad = np.abs(got - h) > steps * (1 + 2.0 ** -6)
            assert not bad.any(), (f"{name}: {bad.sum()} values off, first at "
                                   f"{np.argwhere(bad)[:3].tolist()}")


@pytest.mark.parametrize("platform", ["cpu", pytest.param("gpu", marks=gpu)])
@pytest.mark.parametrize("name,implementation", [("fp8_w8a8_m1", "w8a8_gpu"),
                                                 ("fp8_g128_w8a8_m5", "mosaic_fp8_blocks")])
def test_w8a8_swiglu_prologue(name, implementation, platform):
    """A W8A8 down projection with the SwiGLU prologue (`linear(..., prologue="swiglu")`):
    the implementation quantizes silu(gate) * up from x [M, 2K] in its one pass, against
    the float64 oracle of that product (the halves' product rounded to bf16, as the
    contract rounds it; a value it moves across an e4m3 tie is allowed for)."""
    case = CASES[name]
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((case.m, 2 * case.k)), jnp.bfloat16)
    x64 = np.asarray(x, np.float64)
    gate, up = x64[:, :case.k], x64[:, case.k:]
    h = np.asarray(jnp.asarray(gate / (1 + np.exp(-gate)) * up, jnp.bfloat16), np.float64)
    with jax.default_device(jax.devices(platform)[0]):
        qw = quantize(build(case)["w"], case.fmt)
        y = jax.jit(functools.partial(linear, prologue="swiglu",
                                      implementation=implementation))(x, qw)
    assert y.shape == (case.m, case.n) and y.dtype == jnp.bfloat16
    want, allowance = oracle(case, h, qw)
    allowance += 2.0 ** -7 * (np.abs(h) @ np.abs(stored_weight(qw)).T)
    err = np.abs(np.asarray(y.astype(jnp.float32), np.float64) - want)
    assert (err <= allowance).all(), f"max excess {np.max(err - allowance):.3g}"


def test_weight_is_a_pytree_with_static_activation_mode():
    qw = quantize(np.ones((128, 256), np.float32), "fp8")
    leaves, treedef = jax.tree_util.tree_flatten(qw)
    assert len(leaves) == 2  # values, scales (no offsets)
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(again, QuantizedWeight) and again.activations == "fp8"


MOSAIC_CONFIGS = {
    "one_consumer": dict(compute_wgs=1, pieces_per_step=1, num_stages=2),
    "split_k_2": dict(k_splits=2, pieces_per_step=2, num_stages=2),
    "deep_ring": dict(pieces_per_step=2, num_stages=4),
    "tile_m_8": dict(tile_m=8, pieces_per_step=2, num_stages=2),
    "mma_sync": dict(mma_sync=True, pieces_per_step=2, num_stages=2),
}


@pytest.mark.parametrize("platform", ["cpu", pytest.param("gpu", marks=gpu)])
@pytest.mark.parametrize("config", list(MOSAIC_CONFIGS))
@pytest.mark.parametrize("name", ["int8_m200", "int4_g128_m16", "int4_g32_asym_m2",
                                  "mxfp4_m5"])
def test_mosaic_configs(name, config, platform):
    """The Mosaic kernel's tilings (consumers, split-K, ring depth, token tiles over
    several M tiles, which the registry sends to XLA) agree too."""
    cfg = mosaic_gpu_kernel.Config(**{**dict(tile_m=16), **MOSAIC_CONFIGS[config]})
    _check_mosaic_kernel(name, platform, f"{name}/{config}", config=cfg)


def _check_mosaic_kernel(name: str, platform: str, label: str, **options):
    """The Mosaic kernel with these options on case `name` agrees with the float64 oracle
    within the format's allowance."""
    case = CASES[name]
    b = build(case)
    with jax.default_device(jax.devices(platform)[0]):
        qw = quantize(b["w"], case.fmt)
        y = jax.jit(functools.partial(mosaic_gpu_kernel.quantized_matmul_mgpu, **options))(
            jnp.asarray(b["x"], case.dtype), qw)
    y = np.asarray(y.astype(jnp.float32), np.float64)
    want, allowance = oracle(case, b["x"], qw)
    assert np.isfinite(y).all() and (np.abs(y - want) <= allowance).all(), (
        f"{label}: max excess {np.max(np.abs(y - want) - allowance):.3g}")


def test_mosaic_picks_mma_sync_for_4_bit_weights_in_8_token_tiles():
    """mma.sync where it was timed faster (4-bit weights, 8-token tiles), wgmma elsewhere;
    32-bit words under mma.sync where the weights allow them."""
    choose = mosaic_gpu_kernel.choose_config
    assert choose(1, 4096, 4096, 128, 4).mma_sync
    assert choose(8, 4096, 4096, 64, 4).mma_sync
    assert not choose(16, 4096, 4096, 128, 4).mma_sync  # 16-token tiles
    assert not choose(1, 4096, 4096, 128, 8).mma_sync  # int8
    assert choose(1, 4096, 4096, 128, 4, words32=True).words32
    assert not choose(1, 4096, 4096, 128, 4).words32
    assert not choose(16, 4096, 4096, 128, 4, words32=True).words32  # wgmma there
    # 32-bit words take 16 KB of weights a step (four 4 KB int4 pieces), other forms 32.
    assert choose(1, 6144, 4096, 128, 4, words32=True).pieces_per_step == 4
    assert choose(1, 6144, 4096, 128, 4).pieces_per_step == 8
    # Two CTAs an SM (no register hand-over) only where mma.sync CTAs outnumber the SMs.
    assert choose(1, 28672, 4096, 128, 4, words32=True).share_sm  # 448 CTAs
    assert not choose(1, 6144, 4096, 128, 4, words32=True).share_sm  # 96
    assert not choose(16, 28672, 4096, 128, 4).share_sm  # wgmma


SYNC = mosaic_gpu_kernel.Config(mma_sync=True, tile_m=8, pieces_per_step=2, num_stages=2)
WORDS32 = mosaic_gpu_kernel.Config(mma_sync=True, words32=True, tile_m=8, pieces_per_step=2,
                                   num_stages=2)
WORDS32_SHARED = dataclasses.replace(WORDS32, share_sm=True)


@pytest.mark.parametrize("platform", ["cpu", pytest.param("gpu", marks=gpu)])
@pytest.mark.parametrize("name", ["int4_m1", "int4_g128_m16", "int4_g64_m33",
                                  "int4_g128_asym_m300", "mxfp4_m5", "nvfp4_m64"])
def test_mosaic_words32(name, platform):
    """4-bit codes as 32-bit words in the mma.sync operand layout (`Config.words32`: int4
    per channel, in groups of 128 and 64, with zero points over several token tiles; MXFP4
    and NVFP4) agree with the oracle."""
    _check_mosaic_kernel(name, platform, name, config=WORDS32)


@pytest.mark.parametrize("platform", ["cpu", pytest.param("gpu", marks=gpu)])
@pytest.mark.parametrize("name", ["int4_g128_m16", "mxfp4_m5"])
def test_mosaic_share_sm(name, platform):
    """mma.sync consumers without the register hand-over (`Config.share_sm`) agree too;
    wgmma's consumers, which need the hand-over's registers, refuse it."""
    _check_mosaic_kernel(name, platform, name, config=WORDS32_SHARED)
    wgmma_shared = mosaic_gpu_kernel.Config(tile_m=8, pieces_per_step=2, num_stages=2,
                                            share_sm=True)
    with pytest.raises(ValueError, match="share_sm takes mma_sync"):
        _check_mosaic_kernel(name, platform, name, config=wgmma_shared)


@pytest.mark.parametrize("fmt,options", [
    ("int8", {}), ("int4:g128", {}), ("int4:g32:asym", {}),
    ("mxfp4", {}), ("nvfp4", {}),
    # mma.sync in place of wgmma: per-channel and group-wise, fp4 words.
    ("int8", dict(config=SYNC)), ("int4:g128", dict(config=SYNC)),
    ("int4:g32:asym", dict(config=SYNC)),
    ("mxfp4", dict(config=SYNC)), ("nvfp4", dict(config=SYNC)),
    ("int4", dict(config=WORDS32)), ("int4:g128", dict(config=WORDS32)),
    ("mxfp4", dict(config=WORDS32)), ("nvfp4", dict(config=WORDS32)),
    ("int4:g128", dict(config=WORDS32_SHARED))])
def test_mosaic_kernel_lowers_for_hopper(monkeypatch, fmt, options):
    """The compiled (not interpreted) kernel lowers for a CUDA device from the CPU: every
    op it uses has a Mosaic GPU lowering in its register layout (interpret mode runs the
    same kernel as plain arrays and would not notice). Compiling it needs a GPU."""
    kernel = mosaic_gpu_kernel.quantized_matmul_mgpu
    monkeypatch.setattr(mosaic_gpu_kernel, "mosaic_interpret_params", lambda: None)
    w = quantize(np.random.default_rng().standard_normal((128, 512)), fmt)
    x = jax.ShapeDtypeStruct((3, 512), jnp.bfloat16)
    kernel.clear_cache()  # traced here without interpret mode: kept from no other test
    try:
        lowered = jax.jit(functools.partial(kernel, **options)).trace(
            x, w).lower(lowering_platforms=("cuda",))
    finally:
        kernel.clear_cache()
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize("fmt,k_splits", [("fp8:g128", None), ("fp8:g128", 1),
                                           ("fp8:g64", None), ("fp8:g64", 1)])
def test_fp8_blocks_kernel_lowers_for_hopper(monkeypatch, fmt, k_splits):
    """The W8A8 group-wise kernel lowers for a CUDA device from the CPU (its fp8 wgmma,
    the scales' layouts, the TMA views), with K split (small M's default) and whole (its
    pairs of steps in flight): interpret mode would not notice a missing lowering."""
    kernel = fp8_blocks_kernel.fp8_blocks_matmul_mgpu
    monkeypatch.setattr(fp8_blocks_kernel, "mosaic_interpret_params", lambda: None)
    w = quantize(np.random.default_rng().standard_normal((256, 512)), fmt)
    xq = jax.ShapeDtypeStruct((200, 512), jnp.float8_e4m3fn)
    x_scales = jax.ShapeDtypeStruct((200, 1), jnp.float32)
    kernel.clear_cache()
    try:
        lowered = jax.jit(functools.partial(kernel, k_splits=k_splits)).trace(
            xq, x_scales, w).lower(lowering_platforms=("cuda",))
    finally:
        kernel.clear_cache()
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize("name,k_splits", [("fp8_g128_w8a8_m5", 1), ("fp8_g128_w8a8_m5", 2),
                                           ("fp8_g64_w8a8_m130", 1)])
def test_fp8_blocks_kernel_k_splits(monkeypatch, name, k_splits):
    """The W8A8 group-wise kernel with K's groups split otherwise than small M's default
    (which splits these cases' K to a group a CTA, tested through the registry above):
    whole (pairs of steps in flight, and an odd step after them) and in two parts, each
    against the float64 oracle (interpret mode)."""
    case = CASES[name]
    kernel = fp8_blocks_kernel.fp8_blocks_matmul_mgpu
    monkeypatch.setattr(fp8_blocks_kernel, "choose_k_splits", lambda *_: k_splits)
    b = build(case)
    qw = quantize(b["w"], case.fmt)
    kernel.clear_cache()  # traced with the patched choice: kept from no other test
    try:
        y = linear(jnp.asarray(b["x"], case.dtype), qw, implementation="mosaic_fp8_blocks")
    finally:
        kernel.clear_cache()
    y = np.asarray(y.astype(jnp.float32), np.float64)
    want, allowance = oracle(case, b["x"], qw)
    assert np.isfinite(y).all() and (np.abs(y - want) <= allowance).all(), (
        f"max excess {np.max(np.abs(y - want) - allowance):.3g}")


# int4 cases whose weights may be stored in the Mosaic kernel's chunk order (groups of 64 or
# more), with the implementations that may meet such weights (the kernel on its decode
# steps, with 32-bit words or, for f16 x, without; the XLA references on the others).
CHUNKED = [("int4_m1", "mosaic_gpu"), ("int4_g128_m16", "mosaic_gpu"),
           ("int4_f16_act", "mosaic_gpu"), ("int4_g64_m33", "reference"),
           ("int4_g128_asym_m300", "reference"), ("int4_g128_m16", "fixed_rows")]


@pytest.mark.parametrize("platform", ["cpu", pytest.param("gpu", marks=gpu)])
@pytest.mark.parametrize("name,implementation", CHUNKED)
def test_values_stored_in_the_chunks_order(name, implementation, platform):
    """Values stored in the chunks' order (`QuantizedWeight.k_order`, as the loader keeps
    int4 weights on Hopper) give the product of the weight they were permuted from: the
    kernel then reads x as it is, the references permute x instead."""
    case = CASES[name]
    b = build(case)
    with jax.default_device(jax.devices(platform)[0]), jax.default_matmul_precision("highest"):
        qw = quantize(b["w"], case.fmt)
        chunked = qw.in_chunk_order()
        assert chunked.k_order == "chunks"
        assert not np.array_equal(np.asarray(chunked.values), np.asarray(qw.values))
        np.testing.assert_array_equal(np.asarray(dequantize(chunked)),
                                      np.asarray(dequantize(qw)))
        np.testing.assert_array_equal(np.asarray(chunked.in_k_order().values),
                                      np.asarray(qw.values))
        x = jnp.asarray(b["x"], case.dtype)
        y = jax.jit(functools.partial(linear, implementation=implementation))(x, chunked)
    y = np.asarray(y.astype(jnp.float32), np.float64)
    want, allowance = oracle(case, b["x"], qw)
    err = np.abs(y - want)
    assert (err <= allowance).all(), f"{name}/{implementation}: worst {np.max(err - allowance)}"


@pytest.mark.parametrize("fmt,message", [("int4:g32", "group size 32"),
                                         ("mxfp4", "fp4 weights"), ("int8", "int8 weights")])
def test_chunks_order_only_for_int4_in_whole_tiles(fmt, message):
    qw = quantize(build(Case(fmt, 1, 64, 128))["w"], fmt)
    with pytest.raises(ValueError, match=message):
        qw.in_chunk_order()
    with pytest.raises(ValueError, match="chunk order"):
        pallas_tpu_kernel.quantized_matmul_tpu(jnp.ones((1, 128), jnp.bfloat16),
                                               quantize(build(Case("int4", 1, 64, 128))["w"],
                                                        "int4").in_chunk_order())
