"""Latency of the tensor-parallel all-reduce a decode step pays per block.

A jitted chain of N dependent all-reduces of a [T, hidden] activation over every visible
device (in shard_map, as the model's row-split projections end), against the same chain
with the all-reduce replaced by a local add: the difference over N is one all-reduce's
cost inside a step (wall clock, median of --iters runs). `--impl psum` is XLA's all-reduce
(NCCL, or its own collective kernels as XLA_FLAGS say, e.g.
--xla_gpu_experimental_use_collective_kernels=ALL_REDUCE); `--impl mosaic` is ours
(`jaxinfer.mosaic.all_reduce`, one-shot over peer memory), first checked against a float64
sum of the devices' inputs and for the same bits on every device.

    python bench/allreduce_latency.py --tokens 1 16 64 --hidden 4096 --chain 64 \
        --impl psum mosaic
"""

from __future__ import annotations

import argparse
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer.benchmarks.harness import median_seconds


def reducer(impl: str, capacity: int = 0):
    """(x, peers) -> the sum of x over "tp" (peers: the mosaic workspace's addresses)."""
    if impl == "psum":
        return lambda x, peers: jax.lax.psum(x, "tp")
    from jaxinfer.mosaic.all_reduce import all_reduce_sum

    return partial(all_reduce_sum, axis_name="tp", capacity=capacity)


def chain(x, peers, n: int, reduce):
    for _ in range(n):
        y = reduce(x, peers) if reduce is not None else x + x
        x = jnp.tanh(y)  # keeps the values bounded and each link dependent on the last
    return x


def per_device(mesh, fn):
    """fn(x, peers) in shard_map: x split over "tp", peers replicated."""
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("tp"), P()), out_specs=P("tp"),
                                 check_vma=False))


def check(mesh, peers, reduce, t: int, hidden: int):
    """One all-reduce against float64: error within one bf16 rounding, same bits everywhere."""
    n = mesh.size
    host = np.random.default_rng(t).standard_normal((n, t, hidden)).astype(np.float32)
    x = jax.device_put(jnp.asarray(host.reshape(n * t, hidden), jnp.bfloat16),
                       NamedSharding(mesh, P("tp")))
    y = np.asarray(per_device(mesh, reduce)(x, peers).astype(jnp.float32)).reshape(n, t, hidden)
    exact = np.asarray(x.astype(jnp.float32), np.float64).reshape(n, t, hidden).sum(0)
    err = np.abs(y - exact[None]).max() / np.abs(exact).max()
    same = all(np.array_equal(y[0], y[d]) for d in range(n))
    return err, same


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--chain", type=int, default=64)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--impl", nargs="+", default=["psum"], choices=["psum", "mosaic"])
    args = ap.parse_args()
    mesh = jax.make_mesh((jax.device_count(),), ("tp",),
                         axis_types=(jax.sharding.AxisType.Auto,))
    capacity = 0
    peers = jnp.zeros((mesh.size, 2), jnp.uint32)
    if "mosaic" in args.impl:
        from jaxinfer.mosaic.all_reduce import capacity_for, make_workspace

        workspace = make_workspace(mesh, capacity_for(max(args.tokens) * args.hidden * 2))
        peers, capacity = workspace.peers, workspace.capacity
    print(f"{jax.device_count()} x {jax.devices()[0].device_kind}, chain {args.chain}")
    print("| impl | tokens | bytes | max rel. error | same bits on every device | "
          "step with all-reduces ms | step with local adds ms | per all-reduce us |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for t in args.tokens:
        # Each device holds its own partial sum: a [T, hidden] block of a [n * T, hidden] array.
        x = jax.device_put(jax.random.normal(jax.random.key(t), (mesh.size * t, args.hidden),
                                             jnp.bfloat16), NamedSharding(mesh, P("tp")))
        local = per_device(mesh, partial(chain, n=args.chain, reduce=None))
        base = median_seconds(local, x, peers, iters=args.iters, warmup=1, device_time=False)
        for impl in args.impl:
            reduce = reducer(impl, capacity)
            err, same = check(mesh, peers, reduce, t, args.hidden)
            fn = per_device(mesh, partial(chain, n=args.chain, reduce=reduce))
            wall = median_seconds(fn, x, peers, iters=args.iters, warmup=1, device_time=False)
            per = (wall - base) / args.chain
            print(f"| {impl} | {t} | {t * args.hidden * 2} | {err:.2e} | {same} | "
                  f"{wall * 1e3:.3f} | {base * 1e3:.3f} | {per * 1e6:.1f} |", flush=True)


if __name__ == "__main__":
    main()
