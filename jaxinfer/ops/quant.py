"""Quantized linear weights: the one type every linear layer accepts, and the quantizers.

A `QuantizedWeight` stands for a float weight W [N, K] = (out_features, in_features),
stored K-major like the float weights (8-bit tensor-core operands cannot be
transposed on the fly):

  values   [N, K]                 int8, int4 (two per byte in device memory), float8_e4m3fn
                                  or float4_e2m1fn (MXFP4: group 32, power-of-two scales, as
                                  gpt-oss's experts ship; NVFP4: group 16)
  scales   [K // group_size, N]   float32; per-channel weights have one row (group_size == K)
  offsets  None, or like scales   float32; asymmetric formats (GGUF Q4_1, AWQ zero points)

  W[n, k] = values[n, k] * scales[k // group_size, n]  (+ offsets[k // group_size, n])

A stack of E expert weights W [E, N, K] (MoE, see `jaxinfer.ops.grouped_matmul`) is the
same with a leading expert axis on every part: values [E, N, K], scales [E, K // g, N].

An integer zero point z is the offset -z * scale, so one form covers AWQ's
integer zero points and GGUF Q4_1's float minimum. Scales and offsets are kept
in float32: exact for GGUF's float16 block scales, and 3-6 % of the int4 bytes
at group 128.

`activations="fp8"` (fp8 weights only) makes the matmul quantize activations
per token to e4m3 on the fly (W8A8); otherwise weights are dequantized against
bf16/f32 activations (weight-only).

Formats are named by strings, as on the command line: "int8", "int4" (per
channel), "int4:g128", "int8:g64", "int4:g128:asym", "fp8" (W8A8), "fp8:g128" (W8A8 on
group-wise scales: DeepSeek's blocks), "fp8:weight-only", "mxfp4", "nvfp4".

`k_order="chunks"` (int4 only; set once at load where the Mosaic kernel reads the codes as
32-bit words, `jaxinfer.ops.linear_registry.kernel_k_order`): within each 64-column tile of
K, values (not scales or offsets, whose groups of 64 or more the order keeps) are stored so
that the kernel's mma.sync chunks meet x's columns in their natural order (`chunk_order`),
where x would otherwise be permuted for every product. `dequantize` returns W in K's order
either way; any other product takes x through `from_chunk_order` instead.

The two fp4 formats differ in their scales, kept here as their float32 values: MXFP4's
are powers of two (e8m0) per 32 values; NVFP4's are an e4m3 number per 16 values times
one float32 scale per tensor (per expert in a stack), so a scale is e4m3(b) * t. Hopper
has no fp4 tensor cores: both are weight formats, upcast before the product.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.errors import JaxinferError

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448
GROUP_SIZES = (32, 64, 128)
# Largest magnitude of each integer kind (symmetric formats use [-qmax, qmax]).
INT_QMAX = {"int8": 127, "int4": 7}
VALUE_DTYPES = {"int8": jnp.int8, "int4": jnp.int4, "fp8": FP8_DTYPE,
                "fp4": jnp.float4_e2m1fn}
FP4_MAX = 6.0
MXFP4_GROUP = 32  # OCP microscaling: 32 fp4 values share one power-of-two (e8m0) scale
NVFP4_GROUP = 16  # NVIDIA's: 16 fp4 values share an e4m3 scale (times a per-tensor one)
FP4_FORMATS = {MXFP4_GROUP: "mxfp4", NVFP4_GROUP: "nvfp4"}  # fp4's group size -> its name


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A quantized W [N, K] (see the module docstring for layouts)."""

    values: jax.Array
    scales: jax.Array
    offsets: jax.Array | None = None
    activations: str | None = dataclasses.field(default=None, metadata=dict(static=True))
    k_order: str | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        """(N, K), or (E, N, K) for a stack of expert weights."""
        return tuple(self.values.shape)

    @property
    def kind(self) -> str:
        """'int8', 'int4', 'fp8' or 'fp4'."""
        return {jnp.dtype(v): k for k, v in VALUE_DTYPES.items()}[jnp.dtype(self.values.dtype)]

    @property
    def group_size(self) -> int:
        """K for per-channel scales, else the number of K elements sharing one scale."""
        return self.values.shape[-1] // self.scales.shape[-2]

    @property
    def nbytes(self) -> int:
        """Bytes a matmul reads: values (4-bit kinds at half a byte), scales and offsets."""
        size = self.values.size
        value_bytes = size // 2 if self.kind in ("int4", "fp4") else size
        extra = self.scales.size * 4 * (1 if self.offsets is None else 2)
        return value_bytes + extra

    def expert(self, e: int) -> QuantizedWeight:
        """Expert e's [N, K] weight of an [E, N, K] stack."""
        return QuantizedWeight(self.values[e], self.scales[e],
                               None if self.offsets is None else self.offsets[e],
                               self.activations, self.k_order)

    def in_chunk_order(self) -> QuantizedWeight:
        """This weight with its values stored in the chunks' order (`k_order="chunks"`)."""
        if self.k_order is not None:
            return self
        if reason := chunk_order_unsupported(self):
            raise ValueError(f"in_chunk_order: {reason}")
        return dataclasses.replace(self, values=codes_in_order(self.values, from_chunk_order),
                                   k_order=K_CHUNKS)

    def in_k_order(self) -> QuantizedWeight:
        """This weight with its values in K's own order."""
        if self.k_order is None:
            return self
        return dataclasses.replace(self, values=codes_in_order(self.values, chunk_order),
                                   k_order=None)


# --- the chunks' order of K (`QuantizedWeight.k_order`) ------------------------------------
#
# The Mosaic kernel reads a [64, 8] tile of 32-bit words (eight 4-bit codes each) in mma.sync's
# operand layout: its chunk j's column L = 16 j + 8 h + 2 t + e is the code at tile position
# 32 h + 8 t + 4 e + j (`jaxinfer.mosaic.nibble_words`). `chunk_order` lists each 64-column
# tile of an array in that order; weights stored `from_chunk_order` have chunk column L
# hold K element L, so x needs no permutation.
K_CHUNKS = "chunks"
CHUNK_TILE = 64  # K elements of a [64, 8]-word tile


def chunk_order(a: jax.Array) -> jax.Array:
    """a [..., K] with each 64-column tile's columns in the chunks' order: column
    16 j + 8 h + 2 t + e of a tile is its element 32 h + 8 t + 4 e + j."""
    *lead, k = a.shape
    n = len(lead)
    tiles = a.reshape(*lead, k // CHUNK_TILE, 2, 4, 2, 4)  # (h, t, e, j)
    return tiles.transpose(*range(n + 1), n + 4, n + 1, n + 2, n + 3).reshape(*lead, k)


def from_chunk_order(a: jax.Array) -> jax.Array:
    """The inverse of `chunk_order`: from_chunk_order(chunk_order(a)) == a."""
    *lead, k = a.shape
    n = len(lead)
    tiles = a.reshape(*lead, k // CHUNK_TILE, 4, 2, 4, 2)  # (j, h, t, e)
    return tiles.transpose(*range(n + 1), n + 2, n + 3, n + 4, n + 1).reshape(*lead, k)


def codes_in_order(values: jax.Array, order) -> jax.Array:
    """order(values) (`chunk_order`, `from_chunk_order`) for int4 codes, moved as int8 (not
    every backend transposes int4)."""
    return order(values.astype(jnp.int8)).astype(values.dtype)


def stored_order_reason(w) -> str | None:
    """For a kernel that reads values in K's own order: why it cannot take w (values stored
    in another order, `QuantizedWeight.k_order`), or None."""
    if getattr(w, "k_order", None) is None:
        return None
    return "weights stored in the Mosaic kernel's chunk order"


def chunk_order_unsupported(w: QuantizedWeight) -> str | None:
    """Why w's values cannot be stored in the chunks' order (None if they can): int4 codes
    with K a multiple of 64 and scale groups of 64 or more (a tile's permutation stays
    inside each group)."""
    if w.kind != "int4":
        return f"{w.kind} weights (the chunks' order is int4's)"
    k = w.shape[-1]
    if k % CHUNK_TILE or w.group_size % CHUNK_TILE:
        return (f"K={k} and group size {w.group_size} must be multiples of {CHUNK_TILE}")
    return None


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """What `quantize` produces; `parse_format` reads the command-line spelling."""

    kind: str  # "int8" | "int4" | "fp8" | "fp4" (group 32: MXFP4; group 16: NVFP4)
    group_size: int | None = None  # None: one scale per output channel
    asymmetric: bool = False  # offsets (zero points) per group / channel
    activations: str | None = None  # "fp8": W8A8

    def __str__(self):
        if self.kind == "fp4":
            return FP4_FORMATS[self.group_size]
        parts = [self.kind]
        if self.group_size:
            parts.append(f"g{self.group_size}")
        if self.asymmetric:
            parts.append("asym")
        if self.kind == "fp8" and self.activations is None:
            parts.append("weight-only")
        return ":".join(parts)


def parse_format(spec: str) -> QuantFormat:
    """'int8' | 'int4' | 'int4:g128' | 'int8:g32:asym' | 'fp8' | 'fp8:g128' (W8A8 on
    DeepSeek's block-FP8 weights) | 'fp8:weight-only' | 'fp8:g128:weight-only' | 'mxfp4' |
    'nvfp4'."""
    fp4_groups = {name: g for g, name in FP4_FORMATS.items()}
    if spec in fp4_groups:
        return QuantFormat("fp4", fp4_groups[spec])
    kind, *options = spec.split(":")
    if kind in fp4_groups:  # the formats fix their own groups and scales
        raise JaxinferError(f"--quantize {spec!r}: {kind} takes no options (its scales are "
                            f"one per {fp4_groups[kind]} weights, symmetric)")
    if kind not in ("int8", "int4", "fp8"):
        raise JaxinferError(f"--quantize {spec!r}: unknown format {kind!r} "
                            "(expected int8, int4, fp8, mxfp4 or nvfp4, e.g. int4:g128)")
    group_size, asymmetric = None, False
    activations = "fp8" if kind == "fp8" else None
    for opt in options:
        if opt.startswith("g") and opt[1:].isdigit():
            group_size = int(opt[1:])
            if group_size not in GROUP_SIZES:
                raise JaxinferError(f"--quantize {spec!r}: group size {group_size} is not one "
                                    f"of {', '.join(map(str, GROUP_SIZES))}")
        elif opt == "asym" and kind != "fp8":
            asymmetric = True
        elif opt == "weight-only" and kind == "fp8":
            activations = None
        else:
            raise JaxinferError(f"--quantize {spec!r}: unknown option {opt!r} for {kind}")
    return QuantFormat(kind, group_size, asymmetric, activations)


def quantize(w: jax.Array | np.ndarray, fmt: QuantFormat | str) -> QuantizedWeight:
    """Quantizes a float W [N, K] or a stack [E, N, K] (round to nearest, scales from
    each group's range)."""
    fmt = parse_format(fmt) if isinstance(fmt, str) else fmt
    w = jnp.asarray(w, jnp.float32)
    if w.ndim == 3:
        parts = [quantize(we, fmt) for we in w]
        return QuantizedWeight(
            jnp.stack([p.values for p in parts]), jnp.stack([p.scales for p in parts]),
            None if parts[0].offsets is None else jnp.stack([p.offsets for p in parts]),
            fmt.activations)
    n, k = w.shape
    g = fmt.group_size or k
    if k % g:
        raise JaxinferError(f"cannot quantize a [{n}, {k}] weight with group size {g}: "
                            f"in_features {k} is not a multiple of it")
    groups = w.reshape(n, k // g, g)
    if fmt.kind == "fp4":
        scales = _fp4_scales(groups)
        values = _fp4_values(groups, scales)
        return QuantizedWeight(values.reshape(n, k), scales.T, None, None)
    if fmt.kind == "fp8":
        absmax = jnp.max(jnp.abs(groups), axis=-1)
        scales = jnp.where(absmax > 0, absmax / FP8_MAX, 1.0)
        values = jnp.clip(groups / scales[..., None], -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
        return QuantizedWeight(values.reshape(n, k), scales.T, None, fmt.activations)
    qmax = INT_QMAX[fmt.kind]
    if fmt.asymmetric:
        lo, hi = jnp.min(groups, axis=-1), jnp.max(groups, axis=-1)
        levels = 2 * qmax + 1  # e.g. int4: 15 steps over [-8, 7]
        scales = jnp.where(hi > lo, (hi - lo) / levels, 1.0)
        q = jnp.round((groups - lo[..., None]) / scales[..., None]) - (qmax + 1)
        values = jnp.clip(q, -qmax - 1, qmax)
        offsets = (lo + (qmax + 1) * scales).T
    else:
        absmax = jnp.max(jnp.abs(groups), axis=-1)
        scales = jnp.where(absmax > 0, absmax / qmax, 1.0)
        values = jnp.clip(jnp.round(groups / scales[..., None]), -qmax, qmax)
        offsets = None
    values = values.astype(VALUE_DTYPES[fmt.kind]).reshape(n, k)
    return QuantizedWeight(values, scales.T, offsets, None)


def _fp4_values(groups: jax.Array, scales: jax.Array) -> jax.Array:
    """groups [..., G] / scales [...] rounded to e2m1, clipped to its +-6."""
    return jnp.clip(groups / scales[..., None], -FP4_MAX, FP4_MAX).astype(jnp.float4_e2m1fn)


# fp4 scales tried below the smallest one that clips nothing: down to this fraction of it,
# at which a clipped value's error (absmax - 6 s <= 1.5 s) stays within a quarter of its
# stored 6 s, `error_bound`'s allowance for every e2m1 value.
FP4_MIN_SCALE = 0.8
NVFP4_SCALE_CANDIDATES = 3  # e4m3 steps below it (MXFP4: one power of two)


def _fp4_scales(groups: jax.Array) -> jax.Array:
    """fp4 scales [N, K // g] float32 for groups [N, K // g, g] (g = 32: MXFP4, 16: NVFP4).

    Each group's scale is the one of least squared error among the smallest scale of the
    format with absmax / scale <= 6 (no clipping) and the few below it, down to
    FP4_MIN_SCALE of absmax / 6, which clip the group's largest values but put the rest on
    a finer grid. MXFP4's scales are powers of two (e8m0). NVFP4's are e4m3(b) * t: the
    tensor's t is the power of two that brings its largest group's b into (224, 448]
    (e4m3's top binade; a power of two keeps b * t exact in float32, so b and t can be read
    back out of the product); b is never 0 (e4m3's subnormal step 2^-9 at least). All-zero
    groups get 1 (MXFP4) or t (NVFP4).
    """
    absmax = jnp.max(jnp.abs(groups), axis=-1)
    need = absmax / FP4_MAX  # the smallest scale that clips nothing
    if groups.shape[-1] == NVFP4_GROUP:
        top = jnp.max(absmax)
        t = jnp.where(top > 0, jnp.exp2(jnp.ceil(jnp.log2(top / (FP4_MAX * FP8_MAX)))), 1.0)
        b = jnp.minimum(need / t, FP8_MAX)
        near = b.astype(FP8_DTYPE).astype(jnp.float32)
        scale = jnp.where(near >= b, near, near + _e4m3_step(near, up=True)) * t
        zero_scale, tries = t, NVFP4_SCALE_CANDIDATES

        def down(scale):
            return (scale / t - _e4m3_step(scale / t, up=False)) * t
    else:
        scale = jnp.where(absmax > 0, jnp.exp2(jnp.ceil(jnp.log2(need))), 1.0)
        zero_scale, tries = 1.0, 1

        def down(scale):
            return scale / 2

    def squared_error(scale):
        stored = _fp4_values(groups, scale).astype(jnp.float32) * scale[..., None]
        return jnp.sum(jnp.square(stored - groups), axis=-1)

    best, best_err = scale, squared_error(scale)
    for _ in range(tries):
        scale = down(scale)
        err = squared_error(scale)
        better = (scale >= FP4_MIN_SCALE * need) & (scale > 0) & (err < best_err)
        best, best_err = jnp.where(better, scale, best), jnp.where(better, err, best_err)
    return jnp.where(absmax > 0, best, zero_scale)


def _e4m3_step(b: jax.Array, up: bool) -> jax.Array:
    """The distance from an e4m3 number b >= 0 to its neighbour above (up) or below: 2^(e - 3)
    in the binade [2^e, 2^(e + 1)), 2^-9 among the subnormals (below 2^-6); going down from
    a power of two 2^e crosses into the binade below, a step of 2^(e - 4)."""
    exponent = jnp.floor(jnp.log2(jnp.maximum(b, 2.0 ** -6)))
    step = jnp.exp2(exponent - 3)
    if not up:
        step = jnp.where((b > 2.0 ** -6) & (b == jnp.exp2(exponent)), step / 2, step)
    return step


def dequantize(w: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """W [..., N, K] in dtype (computed in float32), in K's order whatever w's `k_order`."""
    if w.k_order is not None:
        return chunk_order(dequantize(dataclasses.replace(w, k_order=None), dtype))
    *lead, n, k = w.shape
    g = w.group_size
    groups = w.values.astype(jnp.float32).reshape(*lead, n, k // g, g)
    out = groups * jnp.swapaxes(w.scales, -1, -2)[..., None]
    if w.offsets is not None:
        out = out + jnp.swapaxes(w.offsets, -1, -2)[..., None]
    return out.reshape(*lead, n, k).astype(dtype)


def error_bound(w: QuantizedWeight) -> jax.Array:
    """Per-element bound [N, K] on |dequantize(quantize(W)) - W| for round-to-nearest.

    Integers: half a step (scale / 2). fp8 e4m3: 3 mantissa bits, so a relative
    error of 2^-4 of the value, plus half of the smallest subnormal step. fp4 e2m1:
    1 mantissa bit (relative 2^-2), plus half the subnormal step 0.5.
    """
    n, k = w.shape
    scale = jnp.repeat(w.scales.T, w.group_size, axis=1)
    if w.kind == "fp8":
        return (jnp.abs(dequantize(w)) * 2.0 ** -4 + scale * 2.0 ** -10).reshape(n, k)
    if w.kind == "fp4":
        return jnp.abs(dequantize(w)) * 2.0 ** -2 + scale * 0.25
    return scale / 2
