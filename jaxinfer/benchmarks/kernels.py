"""Kernel benchmark inputs and `jaxinfer bench kernels`: attention (decode) and linear layers
against the device ceilings, one roofline row each."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.benchmarks.harness import Ceilings, median_seconds, roofline
from jaxinfer.ops.attention import AttentionMetadata
from jaxinfer.ops.attention_registry import ragged_paged_attention
from jaxinfer.ops.linear_registry import linear


def paged_attention_case(seqs: list[tuple[int, int]], *, num_heads: int = 32,
                         num_kv_heads: int = 8, head_dim: int = 128, page_size: int = 16,
                         dtype=jnp.bfloat16, kv_dtype=None, seed: int = 0,
                         width: int | None = None):
    """Inputs of one ragged paged attention step, seqs = [(q_len, kv_len)] (kv_len counts
    this step's tokens). Returns ((q, k, v, k_pages, v_pages, md), K/V bytes read, FLOPs).

    q [T, num_heads, head_dim], k / v [T, num_kv_heads, head_dim] (`dtype`, T = sum of
    q_len); k_pages / v_pages [num_pages, page_size, num_kv_heads, head_dim] (`kv_dtype`,
    default `dtype`), each sequence's pages shuffled over the pool; page_indices [S, width]
    int32 (`width` pages per sequence, default the fewest that hold the longest; the
    engine pads it to a power of two). FLOPs are causal: query i of a q_len-token chunk
    sees kv_len - q_len + i + 1 keys."""
    kv_dtype = kv_dtype or dtype
    rng = np.random.default_rng(seed)
    tokens = sum(q for q, _ in seqs)
    pages = [-(-kv // page_size) for _, kv in seqs]
    num_pages = sum(pages)
    perm = rng.permutation(num_pages).astype(np.int32)
    page_indices = np.zeros((len(seqs), max(width or 0, max(pages))), np.int32)
    start = 0
    for s, n in enumerate(pages):
        page_indices[s, :n] = perm[start:start + n]
        start += n
    ks = jax.random.split(jax.random.key(seed), 5)
    pool = (num_pages, page_size, num_kv_heads, head_dim)
    q = jax.random.normal(ks[0], (tokens, num_heads, head_dim), dtype)
    k = jax.random.normal(ks[1], (tokens, num_kv_heads, head_dim), dtype)
    v = jax.random.normal(ks[2], (tokens, num_kv_heads, head_dim), dtype)
    k_pages = jax.random.normal(ks[3], pool, dtype).astype(kv_dtype)
    v_pages = jax.random.normal(ks[4], pool, dtype).astype(kv_dtype)
    md = AttentionMetadata(
        cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum([q for q, _ in seqs])]), jnp.int32),
        kv_lens=jnp.asarray([kv for _, kv in seqs], jnp.int32),
        page_indices=jnp.asarray(page_indices), num_seqs=jnp.array([len(seqs)], jnp.int32))
    kv_bytes = sum(2 * kv * num_kv_heads * head_dim * jnp.dtype(kv_dtype).itemsize
                   for _, kv in seqs)
    seen = sum(q * (kv - q) + q * (q + 1) // 2 for q, kv in seqs)
    return (q, k, v, k_pages, v_pages, md), kv_bytes, 4 * seen * num_heads * head_dim


def attention_over_pages(attend, **kw):
    """A jitted fn(q, k, v, k_pages, v_pages, md) (a `paged_attention_case`'s inputs) that
    runs attend(q, k_pages, v_pages, md, sm_scale=head_dim ** -0.5, **kw), a kernel over the
    pages alone: k / v are not written (in the engine the pages are donated and the write is
    an in-place scatter of T rows; here XLA would copy the whole cache first). A kernel that
    returns a tuple gives its first item, the attention output."""
    def run(q, k, v, k_pages, v_pages, md):
        out = attend(q, k_pages, v_pages, md, sm_scale=q.shape[-1] ** -0.5, **kw)
        return out[0] if isinstance(out, tuple) else out

    return jax.jit(run)


def bench_kernels(ceilings: Ceilings, backend: str = "reference", small: bool = False) -> list:
    """Attention (decode) and linear layers against the ceilings. backend: 'reference' today."""
    if backend != "reference":
        raise ValueError(f"backend {backend!r}: only 'reference' exists so far")
    rows = []
    dtype = jnp.bfloat16
    shapes = [(8, 256, 8, 2, 64)] if small else [(64, 2048, 32, 8, 128), (8, 32768, 32, 8, 128)]
    for batch, ctx, hq, hkv, d in shapes:
        # `batch` sequences of `ctx` cached tokens, one new token each
        args, kv_bytes, flops = paged_attention_case(
            [(1, ctx + 1)] * batch, num_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype)
        fn = jax.jit(lambda *a, d=d: ragged_paged_attention(*a, sm_scale=d ** -0.5)[0])
        t = median_seconds(fn, *args)
        rows.append(roofline(f"attention decode ref B={batch} ctx={ctx} Hq={hq} Hkv={hkv} D={d}",
                             t, kv_bytes, flops, ceilings))
    mats = [(1, 256, 256), (64, 256, 256)] if small else [
        (m, 8192, 8192) for m in (1, 16, 128, 4096)]
    key = jax.random.key(1)
    for m, n, k in mats:
        x = jax.random.normal(key, (m, k), dtype)
        w = jax.random.normal(jax.random.fold_in(key, 1), (n, k), dtype)
        t = median_seconds(jax.jit(linear), x, w)
        rows.append(roofline(f"linear ref bf16 M={m} N={n} K={k}", t,
                             2 * (m * k + n * k + m * n), 2 * m * n * k, ceilings))
    return rows
