"""Where a batch-1 decode step's time goes: wall clock of the engine step vs the device kernel
time of the jitted step (CUPTI), and the kernels that take it, grouped by name.

    python bench/decode_breakdown.py --preset llama3-8b --ctx 576
"""

from __future__ import annotations

import argparse
import collections
import functools
import re
import statistics
import time

import jax
import jax.numpy as jnp


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--ctx", type=int, default=576)
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    from jax.experimental.mosaic.gpu import profiler

    from jaxinfer import LLM
    from jaxinfer.benchmarks.harness import weight_bytes
    from jaxinfer.engine.runner import SeqChunk
    from jaxinfer.loading.presets import preset_config, random_model

    config = preset_config(args.preset)
    page_bytes = 16 * config.kv_bytes_per_token(2)  # bf16
    num_pages = 2 * -(-(args.ctx + 1) // 16)  # a small cache: the non-donating twin copies it
    llm = LLM(random_model(config, jnp.bfloat16), kv_cache_bytes=num_pages * page_bytes)
    r = llm.runner
    pages = list(range(-(-(args.ctx + 1) // r.page_size)))
    chunk = [SeqChunk(new_tokens=[7], num_cached=args.ctx, pages=pages)]
    for _ in range(3):
        r.step(chunk)
    walls = []
    for _ in range(args.iters):
        t = time.perf_counter()
        r.step(chunk)
        walls.append(time.perf_counter() - t)
    inputs = r.prepare(chunk)
    t = time.perf_counter()
    for _ in range(args.iters):
        r.prepare(chunk)
    prep = (time.perf_counter() - t) / args.iters
    # profiler.measure calls the function more than once, so time a twin that does not donate
    # the cache (its extra cache copy is small here and shows as copy kernels of its own).
    step = jax.jit(functools.partial(r._forward, sample_tokens=True))
    per_kernel = collections.defaultdict(float)
    totals = []
    for _ in range(args.iters):
        _, kernels = profiler.measure(step, aggregate=False)(r.kv_cache, r.state_leaves, inputs)
        totals.append(sum(ms for _, ms in kernels))
        for name, ms in kernels:
            per_kernel[re.sub(r"[._]\d+$", "", name)] += ms / args.iters
    floor = weight_bytes(llm.model) / 2.95e12 * 1e3
    print(f"wall per engine step (median): {statistics.median(walls) * 1e3:.2f} ms; "
          f"host prepare {prep * 1e3:.3f} ms")
    print(f"device kernel time per step (median): {statistics.median(totals):.2f} ms over "
          f"{len(kernels)} kernels; weight-streaming floor at 2.95 TB/s: {floor:.2f} ms")
    print("| kernel (grouped) | ms per step |\n| --- | --- |")
    for name, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:15]:
        print(f"| {name[:70]} | {ms:.3f} |")


if __name__ == "__main__":
    main()
