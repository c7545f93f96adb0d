"""One-row (batch-1 decode) products on the GPU: XLA's dot against a multiply and a row
reduction, the form `jaxinfer.ops.linear` uses for one row with K >= ONE_ROW_REDUCE_MIN_K.

  python bench/one_row_products.py

For the projection and head shapes of Qwen3-30B-A3B, Llama-3-8B and SmolLM2-135M, bf16:
each form's CUPTI median over calls that cycle through enough weight copies (>= 300 MB)
that each call reads its weight from HBM, not L2; the copy bandwidth is measured in the same
run. The dot is whatever XLA's autotuner picks for it in this process (cuBLAS or Triton).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import profiler

from jaxinfer.benchmarks.harness import measure_ceilings

SHAPES = {  # (N, K) of W
    "qwen3 qkv": (5120, 2048), "qwen3 o": (2048, 4096), "qwen3 router": (128, 2048),
    "qwen3 lm_head": (151936, 2048), "llama8b qkv": (6144, 4096), "llama8b o": (4096, 4096),
    "llama8b gate_up": (28672, 4096), "llama8b down": (4096, 14336),
    "llama8b lm_head": (128256, 4096), "smollm2 lm_head": (49152, 576),
}


def dot(x, w):
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32).astype(x.dtype)


def multiply_reduce(x, w):
    return jnp.sum(x.astype(jnp.float32)[:, None, :] * w.astype(jnp.float32),
                   axis=-1).astype(x.dtype)


def main():
    ceilings = measure_ceilings()
    print(f"copy {ceilings.copy_bytes_per_s / 1e9:.0f} GB/s", flush=True)
    for name, (n, k) in SHAPES.items():
        copies = max(2, min(8, int(300e6 // (n * k * 2)) + 1))
        ws = [jax.random.normal(jax.random.key(i), (n, k), jnp.bfloat16) for i in range(copies)]
        x = jax.random.normal(jax.random.key(99), (1, k), jnp.bfloat16)
        for label, f in (("dot", dot), ("multiply-reduce", multiply_reduce)):
            fn = jax.jit(f)
            for w in ws:
                jax.block_until_ready(fn(x, w))
            times, kernels = [], set()
            for i in range(5 * copies):
                _, per_kernel = profiler.measure(fn, aggregate=False)(x, ws[i % copies])
                times.append(sum(t for _, t in per_kernel))
                kernels |= {kname[:24] for kname, _ in per_kernel}
            us = float(np.median(times)) * 1e3
            gbps = n * k * 2 / us / 1e3
            print(f"{name:16s} {label:16s} {us:8.2f} us {gbps:6.0f} GB/s = "
                  f"{gbps * 1e9 / ceilings.copy_bytes_per_s:6.1%} of copy  {sorted(kernels)}",
                  flush=True)


if __name__ == "__main__":
    main()
