"""Batch-1 decode of a random-weight preset, in one process or in a job of one process per
GPU (`jaxinfer.engine.multihost`): does a tensor-parallel step go faster when each GPU has its own
host process launching its kernels?

Per-token time = (wall of a long generation - wall of a short one) / the extra tokens, both
greedy from the same --input-len-token prompt (prefill and compile cancel out). Process 0
prints one line; the others follow its steps.

    python bench/multiprocess_decode.py --preset llama3-8b --mesh tp=2          # one process
    for i in 0 1; do CUDA_VISIBLE_DEVICES=$i python bench/multiprocess_decode.py \\
        --preset llama3-8b --mesh tp=2 --coordinator 127.0.0.1:12355 --num-processes 2 \\
        --process-id $i & done; wait                                           # two
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine import multihost
from jaxinfer.loading.presets import preset_config, random_model
from jaxinfer.sharding import MeshSpec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--mesh", default="tp=2")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--kv-cache-gb", type=float, default=4)
    ap.add_argument("--coordinator", default=None)
    ap.add_argument("--num-processes", type=int, default=None)
    ap.add_argument("--process-id", type=int, default=None)
    args = ap.parse_args()
    # jax.distributed must start before anything queries the devices (importing does not).
    multihost.initialize(args.coordinator, args.num_processes, args.process_id)
    config = preset_config(args.preset)
    mesh = MeshSpec.parse(args.mesh).meshes()[0]
    max_len = args.input_len + args.output_len + 64
    llm = LLM(random_model(config, jnp.bfloat16, mesh=mesh),
              kv_cache_bytes=int(args.kv_cache_gb * 2**30), max_model_len=max_len,
              max_num_seqs=1, decode_steps=args.decode_steps, mesh=args.mesh)
    if not multihost.is_leader():
        llm.follow()
        return
    prompt = [2 + i % 1000 for i in range(args.input_len)]

    def wall(tokens: int, seed: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        # Another first token each time, so no run hits the prefix cache of the last.
        t = time.perf_counter()
        llm.generate([[2 + seed] + prompt[1:]], params)
        return time.perf_counter() - t

    short, long = args.decode_steps, args.decode_steps + args.output_len
    wall(short, 0), wall(long, 1)  # compile every shape both use
    shorts = sorted(wall(short, 2 + i) for i in range(3))
    longs = sorted(wall(long, 5 + i) for i in range(3))
    per_token = (longs[1] - shorts[1]) / args.output_len
    print(f"{args.preset} mesh {args.mesh}, {jax.process_count()} process(es), "
          f"{jax.device_count()} x {jax.devices()[0].device_kind}: batch-1 decode "
          f"{per_token * 1e3:.2f} ms / token ({1 / per_token:.1f} tokens/s; medians of 3)",
          flush=True)


if __name__ == "__main__":
    main()
