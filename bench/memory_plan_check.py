"""`jaxinfer plan` against real allocation: plans a preset on a mesh for the device's own
memory limit, builds the random-weight model on the mesh, then the engine with the planned KV
cache, then runs one batch, and prints planned vs measured bytes per device (the devices'
memory_stats: bytes_in_use after each stage, peak_bytes_in_use after the batch).

    python bench/memory_plan_check.py [--preset llama3-8b] [--mesh tp=2] [--hbm-gb G]

The limit is memory_stats()["bytes_limit"], what JAX's allocator may hold (already
XLA_PYTHON_CLIENT_MEM_FRACTION of the HBM, 0.75 by default), so the plan uses all of it
(--memory-fraction 1) unless --hbm-gb names the memory instead (then 0.9). On CPU there
are no memory stats: pass --hbm-gb; everything runs and the measured columns say n/a:

    XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
        python bench/memory_plan_check.py --preset tiny --mesh tp=2 --hbm-gb 1
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer import LLM, SamplingParams
from jaxinfer.loading.plan import GiB, plan_memory
from jaxinfer.loading.presets import preset_config, random_model
from jaxinfer.sharding import MeshSpec


def stat(device, key: str) -> int | None:
    stats = device.memory_stats()
    return None if not stats or key not in stats else int(stats[key])


def in_use(devices) -> list[int | None]:
    return [stat(d, "bytes_in_use") for d in devices]


def mib(b) -> str:
    return "n/a" if b is None else f"{b / 2**20:.1f}"


def table(title: str, devices, planned: int, measured: list[int | None]):
    """One row per device: planned and measured GiB and their ratio."""
    print(f"\n{title}\n{'device':<28} {'planned MiB':>12} {'measured MiB':>13} {'ratio':>7}")
    for d, m in zip(devices, measured, strict=True):
        ratio = "n/a" if m is None or not planned else f"{m / planned:.4f}"
        print(f"{str(d):<28} {mib(planned):>12} {mib(m):>13} {ratio:>7}")


def minus(a: list, b: list) -> list:
    return [None if x is None or y is None else x - y for x, y in zip(a, b, strict=True)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--mesh", default="tp=1")
    ap.add_argument("--hbm-gb", type=float, default=None,
                    help="Memory per device in GiB (default: the device's bytes_limit).")
    ap.add_argument("--memory-fraction", type=float, default=None,
                    help="Default 1 of bytes_limit, 0.9 of --hbm-gb.")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--context", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--prompt-len", type=int, default=256,
                    help="Tokens per prompt of the batch run (max-num-seqs prompts).")
    ap.add_argument("--no-run", action="store_true", help="Skip the batch run.")
    args = ap.parse_args()

    spec = MeshSpec.parse(args.mesh)
    meshes = spec.meshes()
    replica0 = list(meshes[0].devices.flat)
    devices = [d for m in meshes for d in m.devices.flat]
    print(f"jax {jax.__version__} · {devices[0].device_kind} · {len(jax.devices())} devices")
    limit = stat(devices[0], "bytes_limit")
    if args.hbm_gb is None and limit is None:
        sys.exit("no memory stats on this device: pass --hbm-gb")
    hbm = int(args.hbm_gb * GiB) if args.hbm_gb is not None else limit
    fraction = args.memory_fraction or (0.9 if args.hbm_gb is not None else 1.0)
    config = preset_config(args.preset)
    plan = plan_memory(config, spec, hbm, dtype=args.dtype, page_size=args.page_size,
                       context=args.context, memory_fraction=fraction,
                       max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, name=args.preset)
    print(f"bytes_limit {mib(limit)} MiB\n{plan.format()}")

    start = in_use(devices)
    model = random_model(config, jnp.dtype(args.dtype), mesh=meshes[0])
    table("weights (bytes_in_use after random_model - before)", replica0, plan.weight_bytes,
          minus(in_use(replica0), start[:len(replica0)]))
    shards = {d: 0 for d in replica0}  # what the arrays hold, whatever the allocator does
    for a in jax.tree.leaves(nnx.state(model, nnx.Param)):
        for s in a.addressable_shards:
            shards[s.device] += s.data.on_device_size_in_bytes()
    print(f"parameter shards: {sorted(set(shards.values()))} bytes per device, planned "
          f"{plan.weight_bytes}")

    llm = LLM(model, kv_cache_bytes=plan.kv_cache_bytes, mesh=spec, page_size=args.page_size,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    del model  # the engine holds the same buffers (no copy on the same mesh)
    pages = llm.runner.num_pages
    print(f"\nengine: {pages} KV pages (planned {plan.num_pages}), max_model_len "
          f"{llm.max_model_len} (planned {plan.max_model_len})")
    planned = plan.weight_bytes + (plan.num_pages + 1) * plan.page_bytes  # + scratch page
    table("weights + KV cache (bytes_in_use after LLM(...) - before)", devices, planned,
          minus(in_use(devices), start))

    if not args.no_run:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(2, config.vocab_size, args.prompt_len).tolist()
                   for _ in range(args.max_num_seqs)]
        llm.generate(prompts, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=4, seed=0))
        table(f"peak after a batch of {args.max_num_seqs} x {args.prompt_len} tokens "
              "(peak_bytes_in_use - start; planned: usable)", devices, plan.usable_bytes,
              minus([stat(d, "peak_bytes_in_use") for d in devices], start))
        print(f"planned reserve {mib(plan.reserve_bytes)} MiB per device")


if __name__ == "__main__":
    main()
