"""The linear layer: its implementations in preference order, and the entry point.

`linear` (the contract's signature: `jaxinfer.ops.linear`, plus `implementation=`)
describes the call (`LinearCall`), asks `REGISTRY.pick` for the first implementation that
supports it, and runs it. Every implementation ends with the contract's bias / row-scale
epilogue (`linear_epilogue`).

  mosaic_gpu      the Mosaic GPU quantized matmul: Hopper, int8 / int4 / fp4 (MXFP4,
                  NVFP4) weight-only `QuantizedWeight`s, up to MAX_KERNEL_M rows (decode)
  pallas_tpu      the Pallas TPU quantized matmul: TPU, `QuantizedWeight`s
  w8a8_gpu        W8A8 (fp8 activations) with per-channel weight scales on Hopper, any
                  number of rows: x quantized per token by a Pallas GPU kernel in one pass
                  over x (`pallas_kernels/fp8_rows_gpu.py`), then the reference's fp8 dot
  mosaic_fp8_blocks  W8A8 with group-wise weight scales (DeepSeek's 128 x 128 blocks) on
                  Hopper: x quantized as for w8a8_gpu, then the Mosaic GPU fp8 kernel that
                  scales each group's partial products (`mosaic/fp8_blocks_matmul.py`)
  one_row_reduce  XLA, float weights: one row (batch-1 decode) with K >= ONE_ROW_REDUCE_MIN_K
                  as a multiply and a row reduction, on every platform
  reference       XLA: one dot for float weights, dequantise + dot for quantized ones
  fixed_rows      batch-invariant mode: the reference over blocks of `invariant_rows()`
                  rows (`by_row_blocks`), so each dot has the same shape whatever the
                  number of rows (XLA picks a dot's algorithm by its M: registry.py,
                  INVARIANT_ROWS)

The kernels' own `unsupported_reason` says what inputs a kernel can take (formats, dtypes,
tiling); the predicates here add the platform and the size rules. `implementation="name"`
forces one (tests, benchmarks): kernels then run in interpret mode off their hardware, and
raise ValueError for inputs they cannot take.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.ops.linear import (
    LinearCall,
    Weight,
    check_features,
    linear_epilogue,
    linear_reference,
    one_row_product,
    quantized_product,
    swiglu_halves,
    w8a8_product,
)
from jaxinfer.ops.platform import needs, platform
from jaxinfer.ops.quant import CHUNK_TILE, K_CHUNKS, QuantizedWeight, chunk_order_unsupported
from jaxinfer.ops.registry import Implementation, KernelModule, Registry, by_row_blocks

mosaic_gpu_kernel = KernelModule("jaxinfer.mosaic.quantized_matmul", "hopper")
pallas_tpu_kernel = KernelModule("jaxinfer.pallas_kernels.quantized_matmul", "tpu")
fp8_rows_gpu_kernel = KernelModule("jaxinfer.pallas_kernels.fp8_rows_gpu", "hopper")
fp8_blocks_kernel = KernelModule("jaxinfer.mosaic.fp8_blocks_matmul", "hopper")

# Up to this many rows (tokens) the Mosaic kernel runs; above it the reference, whose dot
# XLA fuses with the per-channel dequantisation (group-wise weights it dequantises into a
# bf16 copy first). The kernel's token tile stops at 16 (`MAX_TILE_M`: wider tiles gave
# wrong sums on the GPU at times), and XLA was faster there anyway from 64 tokens
# (bench/NOTES.md, Linear and quantized matmul: Token tiles of 32 or 64). The kernel
# itself takes any M, in 16-token tiles.
MAX_KERNEL_M = 16

# One-row products over at least this many input features are a multiply-reduce
# (`one_row_product`); below it XLA's dot was faster (SmolLM2's head, K = 576: 16.5 us
# against 18.1). Why the reduction: XLA runs it with its reduction emitter in one pass over
# W, 4.0-4.6 TB/s on an H200 for the Qwen3 / Llama-3 projections and heads of 16 MB or
# more; as a dot, XLA's autotuner picks cuBLAS or a Triton GEMM anew at each compilation,
# timing them with W in L2: from HBM up to 2.5x slower (bench/NOTES.md, Linear and quantized
# matmul: One-row products as multiply-reduce).
ONE_ROW_REDUCE_MIN_K = 1024


def _quantized_reason(call: LinearCall) -> str | None:
    return None if call.quantized else "float weights: XLA's dot"


def _mosaic_gpu_supports(call: LinearCall) -> str | None:
    if (reason := needs("hopper") or _quantized_reason(call)) is not None:
        return reason
    if call.rows > MAX_KERNEL_M:
        return (f"{call.rows} rows: more than MAX_KERNEL_M ({MAX_KERNEL_M}), where XLA is "
                "faster")
    return mosaic_gpu_kernel.unsupported_reason(call.x, call.weight)


def _pallas_tpu_supports(call: LinearCall) -> str | None:
    return (needs("tpu") or _quantized_reason(call)
            or pallas_tpu_kernel.unsupported_reason(call.x, call.weight))


def _w8a8_reason(call: LinearCall) -> str | None:
    if (reason := needs("hopper") or _quantized_reason(call)) is not None:
        return reason
    if call.weight.activations != "fp8":
        return "weight-only formats: the other kernels or the reference"
    return fp8_rows_gpu_kernel.supports(call.x)


def _w8a8_gpu_supports(call: LinearCall) -> str | None:
    if (reason := _w8a8_reason(call)) is not None:
        return reason
    if call.weight.group_size != call.weight.shape[1]:
        return "group-wise weight scales: mosaic_fp8_blocks"
    return None


def _fp8_blocks_supports(call: LinearCall) -> str | None:
    if (reason := _w8a8_reason(call)) is not None:
        return reason
    xq = jax.ShapeDtypeStruct(call.x.shape, jnp.float8_e4m3fn)
    return fp8_blocks_kernel.unsupported_reason(xq, call.weight)


def _one_row_reduce_supports(call: LinearCall) -> str | None:
    if call.quantized:
        return "quantized weights: their kernels or the reference"
    if call.rows != 1:
        return f"{call.rows} rows: the reduction is for one"
    k = call.x.shape[1]
    if k < ONE_ROW_REDUCE_MIN_K:
        return (f"K={k}: less than ONE_ROW_REDUCE_MIN_K ({ONE_ROW_REDUCE_MIN_K}), where "
                "XLA's dot is faster")
    return None


def _kernel(name: str, kernel: KernelModule, matmul: str):
    """A quantized kernel `kernel.matmul`(x [M, K], w) -> [M, N] as a linear implementation."""
    def run(x, weight: Weight, bias=None, row_scale=None, *, rounded=False):
        del rounded  # a quantized product is in x.dtype already
        if not isinstance(weight, QuantizedWeight):
            raise ValueError(f"linear {name}: takes a QuantizedWeight, got a float weight")
        return linear_epilogue(quantized_product(getattr(kernel, matmul), x, weight), x.dtype,
                               bias, row_scale)
    return run


def _w8a8(name: str, matmul):
    """A W8A8 implementation: x [M, K] quantized per token by the Pallas GPU kernel (which
    applies the SwiGLU prologue in the same pass: x then [M, 2K]), then
    matmul(xq, x_scales, w, x.dtype) -> [M, N]."""
    def run(x, weight: Weight, bias=None, row_scale=None, *, rounded=False, prologue=None):
        del rounded  # a quantized product is in x.dtype already
        if not isinstance(weight, QuantizedWeight) or weight.activations != "fp8":
            raise ValueError(f"linear {name}: takes a QuantizedWeight with fp8 activations "
                             "(W8A8: --quantize fp8)")

        xq, x_scales = fp8_rows_gpu_kernel.quantize_rows_fp8_gpu(
            x.reshape(-1, x.shape[-1]), swiglu=prologue == "swiglu")
        y = matmul(xq, x_scales, weight, x.dtype).astype(x.dtype)
        return linear_epilogue(y.reshape(*x.shape[:-1], weight.shape[0]), x.dtype, bias,
                               row_scale)
    return run


def _fp8_blocks(xq, x_scales, w: QuantizedWeight, dtype):
    return fp8_blocks_kernel.fp8_blocks_matmul_mgpu(xq, x_scales, w, out_dtype=dtype)


def fixed_rows(x, weight: Weight, bias=None, row_scale=None, *, rounded=False):
    """`linear_reference` on `invariant_rows()` rows at a time (`by_row_blocks`)."""
    if row_scale is None:
        return by_row_blocks(lambda b: linear_reference(b, weight, bias, rounded=rounded), x)
    return by_row_blocks(lambda b, s: linear_reference(b, weight, bias, s), x, row_scale)


def _one_row_reduce(x, weight: Weight, bias=None, row_scale=None, *, rounded=False):
    del rounded  # a reduction: XLA fuses the cast into it
    if isinstance(weight, QuantizedWeight):
        raise ValueError("linear one_row_reduce: takes float weights, got a QuantizedWeight")
    return linear_epilogue(one_row_product(x, weight), x.dtype, bias, row_scale)


REGISTRY = Registry("linear", [
    Implementation("mosaic_gpu",
                   _kernel("mosaic_gpu", mosaic_gpu_kernel, "quantized_matmul_mgpu"),
                   _mosaic_gpu_supports),
    Implementation("pallas_tpu",
                   _kernel("pallas_tpu", pallas_tpu_kernel, "quantized_matmul_tpu"),
                   _pallas_tpu_supports),
    Implementation("w8a8_gpu", _w8a8("w8a8_gpu", w8a8_product), _w8a8_gpu_supports,
                   fuses=("swiglu",)),
    Implementation("mosaic_fp8_blocks", _w8a8("mosaic_fp8_blocks", _fp8_blocks),
                   _fp8_blocks_supports, fuses=("swiglu",)),
    Implementation("one_row_reduce", _one_row_reduce, _one_row_reduce_supports),
    Implementation("reference", linear_reference, lambda call: None),
    Implementation("fixed_rows", fixed_rows, lambda call: None, batch_invariant=True),
])


def kernel_k_order(weight: QuantizedWeight, shard_k: int, x_dtype,
                   on: str | None = None) -> str | None:
    """The K order (`QuantizedWeight.k_order`) to store `weight` in, once, at load, for the
    kernel this registry picks for its decode steps: "chunks" on Hopper for int4 weights
    that the Mosaic kernel reads as 32-bit words (bf16 x, scale groups of 64 or more, each
    device's `shard_k` input features whole 64-column tiles), so that decode steps do not
    permute x for each product (a kernel of its own in front of o: bench/NOTES.md, Linear
    and quantized matmul); None (K's own order) elsewhere. Other implementations take
    either order (the reference permutes x's columns instead: a prefill's x is small
    beside its weights). `on`: the platform to decide for (default: this process's)."""
    if ((on or platform()) != "hopper" or len(weight.shape) != 2 or x_dtype != jnp.bfloat16
            or chunk_order_unsupported(weight) is not None or shard_k % CHUNK_TILE):
        return None
    return K_CHUNKS


def linear(x: jax.Array, weight: Weight, bias: jax.Array | None = None,
           row_scale: jax.Array | None = None, *, rounded: bool = False,
           prologue: str | None = None, implementation: str | None = None) -> jax.Array:
    """x [..., K] @ weight [N, K]^T (* row_scale [..., 1]) (+ bias [N]) -> [..., N] in x.dtype
    (`jaxinfer.ops.linear` has the contract, and what `rounded` and `prologue` ask).
    `implementation` forces one of REGISTRY.names; None picks the first that supports the
    call. A prologue the implementation does not do itself (`fuses`) runs here first."""
    check_features(x, weight, prologue)
    call = LinearCall.describe(x, weight, prologue)
    impl = REGISTRY.pick(call, implementation)
    if prologue is None:
        return impl.fn(x, weight, bias, row_scale, rounded=rounded)
    if prologue in impl.fused(call):
        return impl.fn(x, weight, bias, row_scale, rounded=rounded, prologue=prologue)
    return impl.fn(swiglu_halves(x, x.dtype), weight, bias, row_scale, rounded=rounded)
