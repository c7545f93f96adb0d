"""Probe: does running the layers as a lax.scan over stacked weights cost decode speed?

L layers of h = linear(h, W_l) (W_l [N, N] bf16, or int8) chained, timed with one array per
layer (unrolled, as the decoder runs today) and with one stacked [L, N, N] array (scanned),
for the linear implementations a step uses: one_row_reduce (bf16, one row), XLA's dot (bf16,
16 and 512 rows) and the Mosaic kernel (int8, one row). Prints the median ms per call.
    python bench/scan_layers_probe.py   (with XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true
    for XLA's in-place slices of custom-call operands)
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.ops.linear_registry import linear
from jaxinfer.ops.quant import quantize

L, N = 32, 4096


def median_ms(fn, *args, iters: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def main():
    key = jax.random.key(0)
    w = (0.02 * jax.random.normal(key, (L, N, N), jnp.float32)).astype(jnp.bfloat16)
    for label, rows, fmt in [("bf16 one row", 1, None), ("bf16 16 rows", 16, None),
                             ("bf16 512 rows", 512, None), ("int8 one row", 1, "int8")]:
        stacked = w if fmt is None else jax.jit(jax.vmap(lambda m, f=fmt: quantize(m, f)))(w)
        layers = [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(L)]
        x = jax.random.normal(key, (rows, N), jnp.bfloat16)

        @jax.jit
        def unrolled(h, ws):
            for wl in ws:
                h = linear(h, wl)
            return h

        @jax.jit
        def scanned(h, ws):
            return jax.lax.scan(lambda h, wl: (linear(h, wl), None), h, ws)[0]

        tu, ts = median_ms(unrolled, x, layers), median_ms(scanned, x, stacked)
        print(f"{label}: unrolled {tu:.3f} ms, scanned {ts:.3f} ms, scanned / unrolled "
              f"{ts / tu:.3f}", flush=True)


if __name__ == "__main__":
    main()
