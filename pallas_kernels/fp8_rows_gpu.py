"""W8A8's per-token activation quantization in one pass: a Pallas kernel, GPU (Triton)
lowering, one program per row.

    quantize_rows_fp8_gpu(x, swiglu=False) -> (values, scales)

  x       [M, K] bf16, f16 or f32; any K (a program holds its row whole in registers,
          padded to a power of two and masked). With `swiglu`, [M, 2K]: the gate | up
          halves, of which the row quantized is silu(gate) * up, computed in float32 and
          rounded to x's dtype (`jaxinfer.ops.linear.swiglu_halves`), so that a W8A8 down
          projection reads gate_up's product once, with no SwiGLU kernel before it
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

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jaxinfer.ops.linear import quantize_rows_fp8
from jaxinfer.ops.quant import FP8_DTYPE


def _kernel(x_ref, values_ref, scales_ref, *, k: int, swiglu: bool):
    """Row r = program 0: x_ref [M, K] (swiglu: [M, 2K]) -> values_ref [M, K], scales_ref
    [M, 1]."""
    r = pl.program_id(0)
    cols = lax.iota(jnp.int32, pl.next_power_of_2(k))
    inside = cols < k
    x = pl_triton.load(x_ref.at[r, cols], mask=inside, other=0).astype(jnp.float32)
    if swiglu:  # x holds gate; its up half K columns on (padding: silu(0) * 0 = 0)
        up = pl_triton.load(x_ref.at[r, cols + k], mask=inside, other=0).astype(jnp.float32)
        x = (x * jax.nn.sigmoid(x) * up).astype(x_ref.dtype).astype(jnp.float32)
    values, scale = quantize_rows_fp8(x, jnp.max(jnp.abs(x)))
    pl_triton.store(values_ref.at[r, cols], values, mask=inside)
    scales_ref[r, 0] = scale


def supports(x, swiglu: bool = False) -> str | None:
    """None if the kernel takes x, else why not."""
    if x.ndim != 2 or x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        return f"x {x.dtype}{list(x.shape)}: takes [M, K] bf16, f16 or f32"
    if swiglu and x.shape[1] % 2:
        return f"x [{x.shape[0]}, {x.shape[1]}]: the SwiGLU's halves need an even width"
    return None


@functools.partial(jax.jit, static_argnames=("swiglu",))
def quantize_rows_fp8_gpu(x: jax.Array, swiglu: bool = False) -> tuple[jax.Array, jax.Array]:
    """See the module docstring: x [M, K] (swiglu: [M, 2K]) -> (e4m3 [M, K], float32
    scales [M, 1])."""
    if (reason := supports(x, swiglu)) is not None:
        raise ValueError(f"fp8 row quantization kernel: {reason}")
    m, k = x.shape[0], x.shape[1] // (2 if swiglu else 1)
    # A row's registers (two arrays of it with the SwiGLU's halves): up to 32 a thread for
    # 4-byte values before more warps.
    num_warps = min(16, max(4, pl.next_power_of_2(k) * (2 if swiglu else 1) // 1024))
    return pl.pallas_call(
        lambda *refs: _kernel(*refs, k=k, swiglu=swiglu), grid=(m,),
        out_shape=[jax.ShapeDtypeStruct((m, k), FP8_DTYPE),
                   jax.ShapeDtypeStruct((m, 1), jnp.float32)],
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=jax.default_backend() != "gpu",
    )(x)
