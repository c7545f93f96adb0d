"""W8A8's per-token activation quantization in one pass: a Pallas kernel, GPU (Triton)
lowering, one program per row.

    quantize_rows_fp8_gpu(x) -> (values, scales)

  x       [M, K] bf16, f16 or f32; any K (a program holds its row whole in registers,
          padded to a power of two and masked)
  values  [M, K] float8_e4m3fn: x / scale, rounded to nearest even, |values| <= 448
  scales  [M, 1] float32: each row's max |x| / 448

The arithmetic of `jaxinfer.ops.linear.quantize_activations_fp8` (the reference), through
the same function (`quantize_rows_fp8`). Triton divides float32s to within 2 ulp, not
rounded as XLA's division is, so a scale may differ from the reference's in its last bits,
and a value by one e4m3 step where x / scale sits that close to a rounding tie. XLA runs
the reference as two kernels, the rows' maxima and then the conversion, which read x
twice; this reads it once, and in a many-row step it is one launch where XLA made two for
each W8A8 product (bench/NOTES.md, Linear and quantized matmul).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jaxinfer.ops.linear import quantize_rows_fp8
from jaxinfer.ops.quant import FP8_DTYPE


def _kernel(x_ref, values_ref, scales_ref, *, k: int):
    """Row r = program 0: x_ref [M, K] -> values_ref [M, K], scales_ref [M, 1]."""
    r = pl.program_id(0)
    cols = lax.iota(jnp.int32, pl.next_power_of_2(k))
    inside = cols < k
    x = pl_triton.load(x_ref.at[r, cols], mask=inside, other=0).astype(jnp.float32)
    values, scale = quantize_rows_fp8(x, jnp.max(jnp.abs(x)))
    pl_triton.store(values_ref.at[r, cols], values, mask=inside)
    scales_ref[r, 0] = scale


def supports(x) -> str | None:
    """None if the kernel takes x, else why not."""
    if x.ndim != 2 or x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        return f"x {x.dtype}{list(x.shape)}: takes [M, K] bf16, f16 or f32"
    return None


@jax.jit
def quantize_rows_fp8_gpu(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """See the module docstring: x [M, K] -> (e4m3 [M, K], float32 scales [M, 1])."""
    if (reason := supports(x)) is not None:
        raise ValueError(f"fp8 row quantization kernel: {reason}")
    m, k = x.shape
    # A row's registers: up to 32 a thread for 4-byte values before more warps.
    num_warps = min(16, max(4, pl.next_power_of_2(k) // 1024))
    return pl.pallas_call(
        lambda *refs: _kernel(*refs, k=k), grid=(m,),
        out_shape=[jax.ShapeDtypeStruct((m, k), FP8_DTYPE),
                   jax.ShapeDtypeStruct((m, 1), jnp.float32)],
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=jax.default_backend() != "gpu",
    )(x)
