"""Where the batch-1 attention kernel's time goes, from inside it: the Mosaic GPU profiler.

  python bench/attention_kernel_regions.py [--ctx 576] [--kv-heads 4]

Prints (1) the CUPTI time of an empty Mosaic GPU kernel (a launch's fixed cost), (2) the
attention kernel's CUPTI time at one decode token (Qwen3-30B-A3B's heads by default) for a
few configs, and (3) one profiled call: per warpgroup of each CTA, the kernel's named
regions (`jax.named_scope` in `_attention_kernel`: wait_q, wait_k, qk, pv, wait_stores) as
name@start+duration in ns from the first CTA's start. Profiling slows the kernel (each
region records timestamps), so read (3) for the order and the relative sizes. The trace
(Perfetto / chrome://tracing) is written to $OUT or /tmp.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import json
import os
import shutil
import tempfile

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from jaxinfer.benchmarks.harness import kernel_times
from jaxinfer.benchmarks.kernels import attention_over_pages, paged_attention_case
from jaxinfer.mosaic.ragged_paged_attention import Config, attend_pages_mgpu

PAGE = 16  # tokens per KV page


def cupti_us(fn, *args, iters=21):
    """[(kernel, median us)] of one call of fn."""
    _, per_kernel = kernel_times(fn, [args], iters=iters)
    return [(name[:40], round(t * 1e6, 2)) for name, t in per_kernel]


def ours(config=None):
    """The Mosaic GPU kernel over the pages (k/v not written)."""
    return attention_over_pages(attend_pages_mgpu, config=config)


def empty_kernel(grid: int, warpgroups: int, smem_kb: int):
    def body(out_ref, smem):
        pass
    return jax.jit(lambda: plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((8, 128), jnp.float32), grid=(grid,),
        grid_names=("cta",), num_threads=warpgroups, thread_name="wg",
        scratch_types=[plgpu.SMEM((smem_kb * 512,), jnp.bfloat16)])())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=576)
    ap.add_argument("--kv-heads", type=int, default=4)
    a = ap.parse_args()
    for grid, wgs, smem_kb in [(8, 2, 1), (8, 2, 200), (132, 2, 200)]:
        print(f"empty kernel, {grid} CTAs x {wgs} warpgroups, {smem_kb} KB shared:",
              cupti_us(empty_kernel(grid, wgs, smem_kb)), flush=True)

    width = 1 << (-(-a.ctx // PAGE) - 1).bit_length()
    args, _, _ = paged_attention_case([(1, a.ctx)], num_kv_heads=a.kv_heads, page_size=PAGE,
                                      width=width)
    for cfg in [None, Config(128, 3, 1, 1, 8), Config(64, 3, 1, 2, 8), Config(64, 6, 1, 1, 8)]:
        print(f"attention {cfg or 'default'}:", cupti_us(ours(cfg), *args), flush=True)

    trace_dir = tempfile.mkdtemp()
    plain = plgpu.CompilerParams
    plgpu.CompilerParams = functools.partial(plain, profile_space=64, profile_dir=trace_dir)
    jax.clear_caches()  # the kernel's cached lowering has no profiler
    try:
        jax.block_until_ready(ours()(*args))
    finally:
        plgpu.CompilerParams = plain
    (trace,) = glob.glob(os.path.join(trace_dir, "*.json"))
    events = json.load(open(trace))["traceEvents"]
    t0 = min(e["ts"] for e in events)
    by_warpgroup = collections.defaultdict(list)
    for e in events:
        by_warpgroup[e["tid"]].append(e)
    for tid, evs in sorted(by_warpgroup.items()):
        open_, spans = [], []
        for e in evs:
            if e["ph"] == "B":
                open_.append(e)
            else:
                b = open_.pop()
                spans.append(f"{b['name']}@{(b['ts'] - t0) * 1e3:.0f}"
                             f"+{(e['ts'] - b['ts']) * 1e3:.0f}")
        print(f"warpgroup trace {tid} (SM {evs[0]['pid'] - 1}): " + " ".join(spans))
    dest = os.path.join(os.environ.get("OUT", "/tmp"), "attention_trace.json")
    shutil.copy(trace, dest)
    print("trace:", dest)


if __name__ == "__main__":
    main()
