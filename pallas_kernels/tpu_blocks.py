"""What the Pallas TPU matmul kernels share (`quantized_matmul.py`, `grouped_matmul.py`):
the default N / K blocks and the rules for tiling a weight [N, K] with them, and the
product of one K block of stored (quantized or float) weight values.

The grouped kernel tiles each expert's [N, K] weights as the dense kernel tiles its one
weight, and runs the same per-block product; its M blocks follow its own rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.ops.linear import dot_nt

LANES = 128
# Block defaults. On TPU: MXU-sized blocks, and bk large enough that one step's
# weight DMA (bn * bk bytes) amortizes the per-step overhead. In interpret mode
# (CPU tests): smaller N / K blocks, so the test shapes cross N and K block
# boundaries and every grid step stays cheap.
TPU_BLOCKS = dict(m=256, n=(512, 256, 128), k=(512, 256, 128))
INTERPRET_BLOCKS = dict(m=128, n=(128,), k=(256, 128))


def round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def running_on_tpu() -> bool:
    return jax.default_backend() == "tpu"


def sublanes(dtype) -> int:
    """Rows of one (sublane, lane) tile: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def default_block_n(n: int, on_tpu: bool) -> int | None:
    choices = (TPU_BLOCKS if on_tpu else INTERPRET_BLOCKS)["n"]
    return next((b for b in choices if n % b == 0), None)


def default_block_k(k: int, g: int, on_tpu: bool) -> int | None:
    """The largest default block dividing K that holds whole groups, else a small K whole."""
    choices = (TPU_BLOCKS if on_tpu else INTERPRET_BLOCKS)["k"]
    if g < k:
        choices = tuple(b for b in choices if b % g == 0) + (g,)
    # A block equal to the full dim escapes the 128-lane rule (K = 96, say).
    choices += (k,) if k <= max(choices) else ()
    return next((b for b in choices if k % b == 0 and (b % LANES == 0 or b == k)), None)


def blocks_reason(n: int, k: int, g: int, bn: int | None, bk: int | None) -> str | None:
    """Why blocks (bn, bk) cannot tile a weight [N, K] with groups of g along K, or None."""
    if bn is None:
        return f"N={n} is not a multiple of 128"
    if n % bn or (bn % LANES and bn != n):
        return f"block_n={bn} must divide N={n} and be a multiple of 128"
    groups = f" and of the group size {g}" if g < k else ""
    if bk is None:
        return f"K={k} has no default block that divides it and is a multiple of 128{groups}"
    if k % bk or (bk % LANES and bk != k) or (g < k and bk % g):
        return f"block_k={bk} must divide K={k} and be a multiple of 128{groups}"
    return None


def dequant_dot(x, w, s_ref, o_ref, *, width: int, scale_per_step: bool, w8a8: bool,
                dot=dot_nt) -> jax.Array:
    """x [bm, bk] . W [bn, bk]^T -> float32 [bm, bn] for one K block of stored values w.

    Per `width`-column unit (a quantization group, or the whole block): the dot of x with
    the values (cast to x's dtype unless W8A8), times the unit's scale row s_ref[t] when
    `scale_per_step`, plus x summed over the unit times its offset row o_ref[t] (o_ref
    None: no offsets). Scales touch float32 partial products, never the weights.
    """
    if not w8a8:
        w = w.astype(x.dtype)
    partial = None
    for t in range(x.shape[1] // width):
        x_t = x[:, t * width:(t + 1) * width]
        d = dot(x_t, w[:, t * width:(t + 1) * width])
        if scale_per_step:
            d = d * s_ref[t:t + 1, :]
        if o_ref is not None:
            d = d + jnp.sum(x_t.astype(jnp.float32), axis=1, keepdims=True) * o_ref[t:t + 1, :]
        partial = d if partial is None else partial + d
    return partial
