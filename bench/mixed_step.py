"""Where a mixed step's time goes: B requests decode at a context of --ctx tokens while new
prompts of --prompt-len tokens keep arriving, so every engine step prefills a chunk beside
the decodes (the throughput run's steps while a wave of requests is admitted). The arrivals
ask for one token, so they leave after their prefill and the batch keeps its shape.

K steps are timed on the host clock, K more run under CUPTI; prints the wall and kernel time
a step, the step's floor (its FLOPs at the matmul rate or its bytes at the copy rate, measured
now) and the costliest kernels.

    python bench/mixed_step.py --preset llama3-8b --batch 248 --ctx 384 --prompt-len 256
        [--quantize fp8] [--kv-cache-dtype fp8]
"""

from __future__ import annotations

import argparse
import json
import time

import jax.numpy as jnp
import numpy as np

from jaxinfer import LLM, SamplingParams
from jaxinfer.benchmarks.harness import kernel_table, measure_ceilings, recorded_kernels
from jaxinfer.loading.presets import preset_config, random_model
from jaxinfer.loading.weights import active_weight_count, step_reads


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--batch", type=int, default=248, help="requests decoding")
    ap.add_argument("--ctx", type=int, default=384, help="their context")
    ap.add_argument("--prompt-len", type=int, default=256, help="each arriving prompt")
    ap.add_argument("--arrivals", type=int, default=0,
                    help="prompts arriving a step (default: enough to fill the token budget)")
    ap.add_argument("--steps", type=int, default=8, help="engine steps per measurement")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--phases", action="store_true",
                    help="also time the host's phases of a step (bench/host_overhead.py's)")
    ap.add_argument("--quantize", default=None,
                    help="the projections quantized to this format (int8, fp8, ...)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    config = preset_config(args.preset)
    ceil = measure_ceilings()  # before the engine plans the device's memory
    # the defaults: KV planned, 2048 tokens
    llm = LLM(random_model(config, jnp.bfloat16, quantize=args.quantize),
              kv_cache_dtype=args.kv_cache_dtype)
    engine = llm.engine
    budget = engine.scheduler.max_num_batched_tokens
    rng = np.random.default_rng(0)
    vocab = config.vocab_size

    def prompt(n):  # random ids: no prefix-cache hits between prompts
        return rng.integers(2, vocab, n).tolist()

    long = SamplingParams(temperature=0, max_tokens=args.ctx + 64 * args.steps,
                          ignore_eos=True)
    for _ in range(args.batch):
        engine.add_request(prompt(args.ctx), long)
    while any(r.num_output == 0 for r in list(engine.running) + list(engine.waiting)):
        engine.step()
    once = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    per_step = args.arrivals or -(-(budget - args.batch) // args.prompt_len)

    def run(steps):
        """`steps` engine steps, `per_step` prompts arriving before each; tokens run a step."""
        runs = []
        for _ in range(steps):
            for _ in range(per_step):
                engine.add_request(prompt(args.prompt_len), once)
            engine.step()
            runs.append(sum(len(c.new_tokens) for _, c in engine.last_batch))
        return runs

    run(6)  # compile the mixed shapes, fill the pipeline
    t = time.perf_counter()
    tokens = run(args.steps)
    wall = (time.perf_counter() - t) / args.steps
    phases = {}
    if args.phases:  # before CUPTI records anything: its hooks slow every launch after
        from host_overhead import timed_phases  # bench/, this script's folder
        with timed_phases() as totals:
            run(args.steps)
        phases = {phase: 1e3 * seconds / args.steps for phase, seconds in totals.items()}
    with recorded_kernels() as kernels:
        run(args.steps)
    busy = sum(ms for _, ms in kernels) / 1e3 / args.steps
    n = float(np.mean(tokens))
    prefill = n - args.batch
    c = config
    flops = (2 * active_weight_count(llm.model) * n
             + 4 * c.num_heads * c.head_dim * c.num_layers
             * (args.batch * args.ctx + prefill * args.prompt_len / 2))
    kv_itemsize = 1 if args.kv_cache_dtype == "fp8" else 2
    kv = (args.batch * args.ctx + prefill) * c.kv_bytes_per_token(kv_itemsize)
    bytes_ = step_reads(llm.model).streamed_bytes(args.batch) + kv
    floor = max(flops / ceil.matmul_flops_per_s, bytes_ / ceil.copy_bytes_per_s)
    result = {"preset": args.preset, "batch": args.batch, "ctx": args.ctx,
              "prompt_len": args.prompt_len, "tokens_per_step": n,
              "wall_ms_per_step": wall * 1e3, "kernel_ms_per_step": busy * 1e3,
              "floor_ms_per_step": floor * 1e3, "tflop_per_step": flops / 1e12,
              "gbytes_per_step": bytes_ / 1e9,
              "matmul_tflops": ceil.matmul_flops_per_s / 1e12,
              "copy_gbps": ceil.copy_bytes_per_s / 1e9,
              "kernels_per_step": len(kernels) / args.steps}
    print(f"{args.preset}: {args.batch} decodes at ctx {args.ctx} + {prefill:.0f} prefill "
          f"tokens a step: wall {wall * 1e3:.2f} ms, kernels {busy * 1e3:.2f} ms, floor "
          f"{floor * 1e3:.2f} ms ({flops / 1e12:.1f} TFLOP, {bytes_ / 1e9:.1f} GB; "
          f"{100 * floor / wall:.1f}% of it reached)")
    for phase, ms in phases.items():
        print(f"host {phase}: {ms:.2f} ms a step")
    result["host_phases_ms_per_step"] = phases
    print(kernel_table(kernels, args.top))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
