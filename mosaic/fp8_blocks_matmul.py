"""W8A8 with group-wise weight scales for Hopper, as a Mosaic GPU kernel (`plgpu.kernel`):
the fp8 product of DeepSeek's block-FP8 format (128 x 128 weight blocks, expanded per output
channel) and of `--quantize fp8:gN`.

    fp8_blocks_matmul_mgpu(xq, x_scales, w) -> y

  xq        [M, K] float8_e4m3fn: x quantized per token (`quantize_activations_fp8`)
  x_scales  [M, 1] float32: its per-token scales
  w         a W8A8 `QuantizedWeight`: values [N, K] float8_e4m3fn, scales [K / g, N]
            float32 (g: the group size, a multiple of 64)
  -> y = x_scales * sum over groups j of (xq[:, group j] @ W[:, group j]^T) * scales[j]
     [M, N] in `out_dtype` (bf16), float32 accumulation

Algorithm: a grid of (N / 128, M / 128, k_splits) CTAs, each an output tile over its part
of K's groups. A producer warpgroup streams, per step, one group (g columns of K) of the
tile's 128 token rows and 128 weight rows, and the group's 128 weight scales, into a
`num_stages`-deep ring by TMA. Two consumer warpgroups take 64 token rows each. Per step
an fp8 wgmma (e4m3 x e4m3, K-major operands as stored) into a fresh float32 accumulator;
that partial product times the group's scales (one per column) is added into the running
sum in registers (the "promotion" DeepGEMM does: the scale changes with the group, so the
groups cannot share one wgmma accumulator). Steps go in pairs, both products issued before
the first is promoted, so that the tensor cores work on the second meanwhile. At the end
the rows' token scales, and a TMA store of the [64, 128] tile: cast to `out_dtype`, or
float32 partial sums that XLA adds where K is split (small M: the output tiles alone
would leave SMs idle; `choose_k_splits`).

M is padded to the 128-row tile (XLA); N must be a multiple of 128 and K of g. Interpret
mode (no GPU) runs the same kernel through Mosaic GPU's interpreter.
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jaxinfer.ops.platform import gpu_sm_count, mosaic_interpret_params
from jaxinfer.ops.quant import FP8_DTYPE, QuantizedWeight

ROWS = 64  # token rows per consumer warpgroup (the wgmma M tile)
CONSUMERS = 2
TILE_M = ROWS * CONSUMERS
TILE_N = 128
NUM_STAGES = 4
NUM_SMS = 132  # H100 / H200 SXM: where no GPU says (interpret mode)


def _transforms(cols: int, itemsize: int):
    """Shared-memory tiling + the widest swizzle a row of `cols` elements fills."""
    row_bytes = cols * itemsize
    for s in (128, 64, 32):
        if row_bytes % s == 0:
            return (plgpu.TilingTransform((8, s // itemsize)), plgpu.SwizzleTransform(s))
    return ()


def _kernel(x_ref, w_ref, s_ref, xs_ref, out_ref, scratch, *, steps: int, stages: int):
    """One (n, m) output tile over `steps` groups of K, from group split * steps on."""
    x_smem, w_smem, s_smem, o_smem, ready, free = scratch
    n_blk, m_blk, wg = lax.axis_index("n"), lax.axis_index("m"), lax.axis_index("wg")
    first = lax.axis_index("split") * steps

    @pl.when(wg == CONSUMERS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")

        def produce(step, _):
            slot = lax.rem(step, jnp.int32(stages))

            @pl.when(step >= stages)
            def _():
                plgpu.barrier_wait(free.at[slot])
            group = first + step
            for c in range(CONSUMERS):
                plgpu.copy_gmem_to_smem(x_ref.at[m_blk * CONSUMERS + c, :, group, :],
                                        x_smem.at[slot, c], ready.at[slot])
            plgpu.copy_gmem_to_smem(w_ref.at[n_blk, :, group, :], w_smem.at[slot],
                                    ready.at[slot])
            plgpu.copy_gmem_to_smem(s_ref.at[group, n_blk], s_smem.at[slot], ready.at[slot])
            return ()

        lax.fori_loop(0, steps, produce, ())

    @pl.when(wg < CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        acc_layout = plgpu.Layout.WGMMA
        cols_layout, rows_layout = acc_layout.reduce(0), acc_layout.reduce(1)
        def promote(i, part, total):
            """total + step i's product times its group's scales; frees step i's slot."""
            slot = lax.rem(i, jnp.int32(stages))
            scales = plgpu.load(s_smem.at[slot], (), layout=cols_layout, optimized=False)

            @pl.when(i + stages < steps)
            def _():
                plgpu.barrier_arrive(free.at[slot])
            return total + part * lax.broadcast_in_dim(scales, part.shape, [1])

        def issue(i, part_ref):
            slot = lax.rem(i, jnp.int32(stages))
            plgpu.barrier_wait(ready.at[slot])
            plgpu.wgmma(part_ref, x_smem.at[slot, wg], w_smem.at[slot].transpose((1, 0)))

        def pair(j, total):
            """Steps 2j and 2j + 1 into two fresh accumulators, both issued at once, so that
            the tensor cores run the second while this warpgroup scales the first."""
            def products(part_a, part_b):
                issue(2 * j, part_a)
                issue(2 * j + 1, part_b)
                t = promote(2 * j, plgpu.wgmma_accumulator_load(part_a, wait_n=1), total)
                return promote(2 * j + 1, plgpu.wgmma_accumulator_load(part_b, wait_n=0), t)
            return pl.run_scoped(products, plgpu.ACC((ROWS, TILE_N), jnp.float32),
                                 plgpu.ACC((ROWS, TILE_N), jnp.float32))

        def single(i, total):
            def product(part_ref):
                issue(i, part_ref)
                return promote(i, plgpu.wgmma_accumulator_load(part_ref, wait_n=0), total)
            return pl.run_scoped(product, plgpu.ACC((ROWS, TILE_N), jnp.float32))

        zeros = plgpu.layout_cast(jnp.zeros((ROWS, TILE_N), jnp.float32), acc_layout)
        acc = lax.fori_loop(0, steps // 2, pair, zeros)
        if steps % 2:
            acc = single(steps - 1, acc)
        token_scales = plgpu.load(xs_ref.at[m_blk * CONSUMERS + wg], (), layout=rows_layout,
                                  optimized=False)
        acc = acc * lax.broadcast_in_dim(token_scales, acc.shape, [0])
        o_smem.at[wg][...] = acc.astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[wg],
                                out_ref.at[lax.axis_index("split"), m_blk * CONSUMERS + wg, :,
                                           n_blk, :])
        plgpu.wait_smem_to_gmem(0)


def unsupported_reason(xq: jax.Array, w: QuantizedWeight) -> str | None:
    """Why the kernel cannot take these inputs (None if it can)."""
    n, k = w.shape
    if w.activations != "fp8" or w.values.dtype != FP8_DTYPE:
        return "takes W8A8 weights (e4m3 values, fp8 activations)"
    if w.group_size == k:
        return "per-channel scales: XLA's fp8 dot"
    if w.group_size % 64:
        return f"group size {w.group_size}: needs a multiple of 64"
    if n % TILE_N:
        return f"N={n} must be a multiple of {TILE_N}"
    if xq.dtype != FP8_DTYPE:
        return f"x dtype {xq.dtype}: needs float8_e4m3fn (quantized per token)"
    return None


def choose_k_splits(tiles: int, steps: int, sms: int = NUM_SMS) -> int:
    """How many parts K's groups are split into: the largest divisor of `steps` that keeps
    tiles x splits within one wave of `sms` CTAs (1 where the tiles fill the GPU already)."""
    return max(d for d in range(1, steps + 1) if steps % d == 0 and (d == 1 or tiles * d <= sms))


@functools.partial(jax.jit, static_argnames=("out_dtype", "k_splits"))
def fp8_blocks_matmul_mgpu(xq: jax.Array, x_scales: jax.Array, w: QuantizedWeight, *,
                           out_dtype=jnp.bfloat16, k_splits: int | None = None) -> jax.Array:
    """See the module docstring: xq [M, K] e4m3, x_scales [M, 1] f32, w -> [M, N].
    `k_splits`: K's groups in that many parts (a divisor of K / g), each a CTA's, summed
    after in float32 (default `choose_k_splits`: small M, where the output tiles alone
    would leave SMs idle)."""
    if (reason := unsupported_reason(xq, w)) is not None:
        raise ValueError(f"mosaic fp8 blocks matmul: {reason}")
    (m, k), n, g = xq.shape, w.shape[0], w.group_size
    steps, m_pad = k // g, -(-m // TILE_M) * TILE_M
    tiles = (n // TILE_N) * (m_pad // TILE_M)
    splits = k_splits or choose_k_splits(tiles, steps, gpu_sm_count(NUM_SMS))
    if steps % splits:
        raise ValueError(f"mosaic fp8 blocks matmul: k_splits={splits} must divide the "
                         f"{steps} groups of K")
    steps //= splits
    stages = min(NUM_STAGES, steps)
    part_dtype = out_dtype if splits == 1 else jnp.float32
    xq = jnp.pad(xq, ((0, m_pad - m), (0, 0)))
    x_scales = jnp.pad(x_scales.astype(jnp.float32).reshape(m), (0, m_pad - m))
    # Views whose TMA offsets fall on leading dimensions only.
    x_view = xq.reshape(m_pad // ROWS, ROWS, steps * splits, g)
    w_view = w.values.reshape(n // TILE_N, TILE_N, steps * splits, g)
    s_view = w.scales.reshape(steps * splits, n // TILE_N, TILE_N)
    xs_view = x_scales.reshape(m_pad // ROWS, ROWS)
    itemsize = jnp.dtype(FP8_DTYPE).itemsize
    scratch = [
        plgpu.SMEM((stages, CONSUMERS, ROWS, g), FP8_DTYPE, transforms=_transforms(g, itemsize)),
        plgpu.SMEM((stages, TILE_N, g), FP8_DTYPE, transforms=_transforms(g, itemsize)),
        plgpu.SMEM((stages, TILE_N), jnp.float32),
        plgpu.SMEM((CONSUMERS, ROWS, TILE_N), part_dtype,
                   transforms=_transforms(TILE_N, jnp.dtype(part_dtype).itemsize)),
    ]
    barriers = (plgpu.Barrier(num_arrivals=CONSUMERS + 2, num_barriers=stages),
                plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages))
    kernel_fn = functools.partial(_kernel, steps=steps, stages=stages)

    def entry(x_ref, w_ref, s_ref, xs_ref, out_ref):
        pl.run_scoped(lambda *s: kernel_fn(x_ref, w_ref, s_ref, xs_ref, out_ref,
                                           (*s[0], *s[1:])),
                      scratch, *barriers, collective_axes="wg")

    y = plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct(
            (splits, m_pad // ROWS, ROWS, n // TILE_N, TILE_N), part_dtype),
        grid=(n // TILE_N, m_pad // TILE_M, splits), grid_names=("n", "m", "split"),
        num_threads=CONSUMERS + 1, thread_name="wg", interpret=mosaic_interpret_params(),
    )(x_view, w_view, s_view, xs_view)
    y = y.reshape(splits, m_pad, n)[:, :m]
    return y[0] if splits == 1 else y.sum(0).astype(out_dtype)
