"""One-row (batch-1 decode) products on the GPU: XLA's dot against a multiply and a row
reduction (`jaxinfer.ops.linear.one_row_product`), the form the linear registry picks for
one row with K >= ONE_ROW_REDUCE_MIN_K.

  python bench/one_row_products.py

For the projection and head shapes of Qwen3-30B-A3B, Llama-3-8B and SmolLM2-135M, bf16:
each form's CUPTI median (`jaxinfer.benchmarks.harness.kernel_times`) over calls that cycle
through 2 to 8 weight copies (about 300 MB in all where the weight allows); each measured
call follows an untimed one on the same copy, so a weight that fits in L2 is read from
there. The copy bandwidth is measured in the same run. The dot is whatever XLA's autotuner
picks for it in this process (cuBLAS or Triton).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from jaxinfer.benchmarks.harness import kernel_times, measure_ceilings
from jaxinfer.ops.linear import float_product, one_row_product

SHAPES = {  # (N, K) of W
    "qwen3 qkv": (5120, 2048), "qwen3 o": (2048, 4096), "qwen3 router": (128, 2048),
    "qwen3 lm_head": (151936, 2048), "llama8b qkv": (6144, 4096), "llama8b o": (4096, 4096),
    "llama8b gate_up": (28672, 4096), "llama8b down": (4096, 14336),
    "llama8b lm_head": (128256, 4096), "smollm2 lm_head": (49152, 576),
}


def dot(x, w):
    """XLA's dot, float32 accumulation, rounded to x's dtype."""
    return float_product(x, w, rounded=False).astype(x.dtype)


def multiply_reduce(x, w):
    """The multiply and row reduction, rounded to x's dtype."""
    return one_row_product(x, w).astype(x.dtype)


def main():
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()  # --help
    ceilings = measure_ceilings()
    print(ceilings.line(), flush=True)
    for name, (n, k) in SHAPES.items():
        copies = max(2, min(8, int(300e6 // (n * k * 2)) + 1))
        ws = [jax.random.normal(jax.random.key(i), (n, k), jnp.bfloat16) for i in range(copies)]
        x = jax.random.normal(jax.random.key(99), (1, k), jnp.bfloat16)
        for label, f in (("dot", dot), ("multiply-reduce", multiply_reduce)):
            seconds, per_kernel = kernel_times(jax.jit(f), [(x, w) for w in ws],
                                               iters=5 * copies, warmup=copies)
            kernels = {kname[:24] for kname, _ in per_kernel}
            us = seconds * 1e6
            gbps = n * k * 2 / us / 1e3
            print(f"{name:16s} {label:16s} {us:8.2f} us {gbps:6.0f} GB/s = "
                  f"{gbps * 1e9 / ceilings.copy_bytes_per_s:6.1%} of copy  {sorted(kernels)}",
                  flush=True)


if __name__ == "__main__":
    main()
