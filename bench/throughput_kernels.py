"""Where a workload's GPU time goes: the offline throughput workload of `jaxinfer bench
throughput`, run once to compile, then again under CUPTI; prints wall time, kernel time
and the kernels with the most time (summed by name).

    python bench/throughput_kernels.py --preset llama3-8b --num-requests 64 \\
        --input-len 1024 --output-len 256 --decode-steps 8
    python bench/throughput_kernels.py --preset gpt-oss-20b --quantize mxfp4 \\
        --num-requests 1 --input-len 512 --output-len 64 --decode-steps 32   # batch-1 decode
"""

from __future__ import annotations

import argparse
import time

import jax.numpy as jnp
import numpy as np

from jaxinfer import LLM, SamplingParams
from jaxinfer.benchmarks.harness import kernel_table, recorded_kernels
from jaxinfer.loading.presets import RandomWeights, preset_config


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--kv-cache-gb", type=float, default=24)
    ap.add_argument("--max-num-seqs", type=int, default=0, help="default: --num-requests")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--quantize", default=None,
                    help="the random projections in this format (as `jaxinfer bench`)")
    args = ap.parse_args()
    config = preset_config(args.preset)
    llm = LLM(RandomWeights(config, jnp.bfloat16, quantize=args.quantize),
              kv_cache_bytes=int(args.kv_cache_gb * 2**30),
              max_model_len=args.input_len + args.output_len + 16,
              max_num_seqs=args.max_num_seqs or args.num_requests,
              max_num_batched_tokens=args.max_num_batched_tokens,
              decode_steps=args.decode_steps)
    rng = np.random.default_rng(0)
    lens = rng.integers(args.input_len // 2, args.input_len + 1, args.num_requests)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)

    def prompts():  # fresh tokens each pass: no prefix-cache hits, same step shapes
        return [rng.integers(2, config.vocab_size, n).tolist() for n in lens]

    llm.generate(prompts(), params)  # compile
    steps0, t = llm.engine.stats().num_steps, time.perf_counter()
    llm.generate(prompts(), params)
    wall = time.perf_counter() - t
    print(f"wall {wall:.2f} s, {llm.engine.stats().num_steps - steps0} engine steps")
    with recorded_kernels() as kernels:
        t = time.perf_counter()
        llm.generate(prompts(), params)
    wall = time.perf_counter() - t
    busy = sum(ms for _, ms in kernels) / 1e3
    print(f"under CUPTI: wall {wall:.2f} s, kernels {busy:.2f} s ({len(kernels)} launches)")
    print(kernel_table(kernels, args.top))


if __name__ == "__main__":
    main()
