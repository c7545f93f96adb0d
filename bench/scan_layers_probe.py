"""Probe: does running the layers as a lax.scan over stacked weights cost decode speed?

L layers of h = linear(h, W_l) (W_l [N, N] bf16, or int8) chained, timed with one array per
layer (unrolled), with one stacked [L, N, N] array (scanned), and unrolled over the stacked
array (static slices), for the linear implementations a step uses: one_row_reduce (bf16, one
row), XLA's dot (bf16, 16 to 512 rows) and the Mosaic kernel (int8, one row); then L layers
of batch-1 decode attention, one page array pair per layer against one pool carried through
the scan (`pool_probe`). Prints the median ms per call.
    python bench/scan_layers_probe.py   (PROBE_N=256 for a small run; XLA_FLAGS=
    --xla_gpu_enable_dynamic_slice_fusion=true for in-place slices of custom-call operands)
"""

import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.ops.linear_registry import linear
from jaxinfer.ops.quant import quantize

L, N = 32, int(os.environ.get("PROBE_N", 4096))


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
                             ("bf16 64 rows", 64, None), ("bf16 256 rows", 256, None),
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

        @jax.jit
        def unrolled_stacked(h, ws):  # one stacked array, static slices
            for i in range(L):
                h = linear(h, jax.tree.map(lambda a, i=i: a[i], ws))
            return h

        tu, ts = median_ms(unrolled, x, layers), median_ms(scanned, x, stacked)
        tus = median_ms(unrolled_stacked, x, stacked)
        print(f"{label}: unrolled {tu:.3f} ms, scanned {ts:.3f} ms, scanned / unrolled "
              f"{ts / tu:.3f}, unrolled over the stacked array / unrolled {tus / tu:.3f}",
              flush=True)

    pool_probe()


def pool_probe(num_pages: int = 2048, page_size: int = 16, kv_heads: int = 8, dim: int = 128,
               heads: int = 32, context: int = 1000):
    """L layers of batch-1 decode attention (each writes its token and reads `context`
    tokens): one (k, v) page array pair per layer (unrolled) against one pool of L *
    num_pages pages carried through a scan, layer l at page offset l * num_pages. A copy of
    the pool per layer would show as milliseconds."""
    from jaxinfer.ops.attention import AttentionMetadata
    from jaxinfer.ops.attention_registry import ragged_paged_attention
    key = jax.random.key(1)
    shape = (num_pages, page_size, kv_heads, dim)
    pages = [tuple(jax.random.normal(k, shape, jnp.bfloat16) for k in jax.random.split(key))
             for _ in range(L)]
    pool = tuple(jnp.concatenate([p[i] for p in pages]) for i in range(2))
    per_seq = -(-context // page_size)
    md = AttentionMetadata(cu_q_lens=jnp.array([0, 1], jnp.int32),
                           kv_lens=jnp.array([context], jnp.int32),
                           page_indices=jnp.arange(per_seq, dtype=jnp.int32)[None] + 7,
                           num_seqs=jnp.array([1], jnp.int32), scratch_page=True)
    x = jax.random.normal(key, (1, (heads + 2 * kv_heads) * dim), jnp.bfloat16)

    def layer(x, kp, vp, md):
        q, k, v = (x[:, :heads * dim].reshape(1, heads, dim),
                   x[:, heads * dim:(heads + kv_heads) * dim].reshape(1, kv_heads, dim),
                   x[:, (heads + kv_heads) * dim:].reshape(1, kv_heads, dim))
        out, kp, vp = ragged_paged_attention(q, k, v, kp, vp, md, sm_scale=dim ** -0.5)
        return x + jnp.tile(out.reshape(1, -1), (1, 2))[:, :x.shape[1]], kp, vp

    @functools.partial(jax.jit, donate_argnums=1)
    def unrolled(x, pages, md):
        new = []
        for kp, vp in pages:
            x, kp, vp = layer(x, kp, vp, md)
            new.append((kp, vp))
        return x, new

    @functools.partial(jax.jit, donate_argnums=1)
    def scanned(x, pool, md):
        def body(carry, g):
            x, (kp, vp) = carry
            md_g = AttentionMetadata(md.cu_q_lens, md.kv_lens, md.page_indices + g * num_pages,
                                     md.num_seqs, scratch_page=True)
            x, kp, vp = layer(x, kp, vp, md_g)
            return (x, (kp, vp)), None
        return jax.lax.scan(body, (x, pool), jnp.arange(L))[0]

    def donated_median_ms(fn, cache, iters: int = 20):
        """The pages are donated: each call takes the ones the call before gave back."""
        times = []
        for i in range(iters + 1):
            t = time.perf_counter()
            _, cache = jax.block_until_ready(fn(x, cache, md))
            if i:
                times.append(time.perf_counter() - t)
        return float(np.median(times)) * 1e3

    tu, ts = donated_median_ms(unrolled, pages), donated_median_ms(scanned, pool)
    print(f"attention, {L} layers, pool of {L * num_pages} pages: unrolled {tu:.3f} ms, "
          f"scanned {ts:.3f} ms, scanned / unrolled {ts / tu:.3f}", flush=True)


if __name__ == "__main__":
    main()
