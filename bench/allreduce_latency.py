"""Latency of the tensor-parallel all-reduce a decode step pays per block.

A jitted chain of N dependent all-reduces of a [T, hidden] activation over every visible
device (in shard_map, as the model's row-split projections end), against the same chain
with the all-reduce replaced by a local add: the difference over N is one all-reduce's
cost inside a step (wall clock, median of --iters runs). Which all-reduce XLA emits (NCCL,
or its own collective kernels) follows XLA_FLAGS, e.g.
--xla_gpu_experimental_use_collective_kernels=ALL_REDUCE.

    python bench/allreduce_latency.py --tokens 1 16 64 --hidden 4096 --chain 64
"""

from __future__ import annotations

import argparse
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer.benchmarks.harness import median_seconds


def chain(x, n: int, reduce: bool):
    for _ in range(n):
        y = jax.lax.psum(x, "tp") if reduce else x + x
        x = jnp.tanh(y)  # keeps the values bounded and each link dependent on the last
    return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--chain", type=int, default=64)
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    mesh = jax.make_mesh((jax.device_count(),), ("tp",))
    print(f"{jax.device_count()} x {jax.devices()[0].device_kind}, chain {args.chain}")
    print("| tokens | bytes | step with all-reduces ms | step with local adds ms | "
          "per all-reduce us |")
    print("| --- | --- | --- | --- | --- |")
    for t in args.tokens:
        # Each device holds its own partial sum: a [T, hidden] block of a [n * T, hidden] array.
        x = jax.device_put(jax.random.normal(jax.random.key(t), (mesh.size * t, args.hidden),
                                             jnp.bfloat16), NamedSharding(mesh, P("tp")))
        wall = {}
        for reduce in (True, False):
            body = partial(chain, n=args.chain, reduce=reduce)
            fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))
            wall[reduce] = median_seconds(fn, x, iters=args.iters, warmup=1,
                                          device_time=False)
        per = (wall[True] - wall[False]) / args.chain
        print(f"| {t} | {t * args.hidden * 2} | {wall[True] * 1e3:.3f} | "
              f"{wall[False] * 1e3:.3f} | {per * 1e6:.1f} |")


if __name__ == "__main__":
    main()
