"""Host overhead between device steps, from a CUPTI profile of the engine's decode steps.

B requests decode at a context of --ctx tokens; K engine steps are timed on the host
clock (what a user waits for), and K more run under CUPTI, which records every kernel
they launch. Host overhead = 1 - (kernel time per generated token / wall time per
generated token): the share of the time the GPU has no kernel to run (scheduler,
input preparation, launches, the copy of the sampled ids back).

    python bench/host_overhead.py --preset llama3-8b --batch 1 --decode-steps 8
"""

from __future__ import annotations

import argparse
import json
import time

import jax.numpy as jnp


def decoding_llm(preset: str, batch: int, ctx: int, decode_steps: int, steps: int,
                 mesh_spec: str | None, min_kv_bytes: int = 8 << 30, page_size: int = 16,
                 quantize: str | None = None):
    """(LLM, mesh) with `batch` requests of `ctx` prompt tokens prefilled and decoding (decode
    shapes compiled), with room for 8 measurements of `steps` engine steps. The KV pool holds
    every sequence's whole length, and at least `min_kv_bytes`. `quantize`: the preset's
    projections quantized to this format."""
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.loading.presets import preset_config, random_model
    from jaxinfer.sharding import MeshSpec

    config = preset_config(preset)
    max_len = ctx + 8 * steps * decode_steps + 64
    mesh = MeshSpec.parse(mesh_spec).meshes()[0]
    # Pages for every sequence's whole length: a smaller pool would preempt and recompute.
    kv_bytes = batch * max_len * config.kv_bytes_per_token(2)  # bf16
    llm = LLM(random_model(config, jnp.bfloat16, mesh=mesh, quantize=quantize),
              kv_cache_bytes=max(min_kv_bytes, int(1.1 * kv_bytes)),
              max_model_len=max_len, max_num_seqs=batch, decode_steps=decode_steps,
              mesh=mesh_spec, page_size=page_size)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_len - ctx - 1, ignore_eos=True)
    for i in range(batch):
        engine.add_request([2 + (i + j) % min(1000, config.vocab_size - 2)
                            for j in range(ctx)], params)
    while any(r.num_output == 0 for r in engine.running + list(engine.waiting)):
        engine.step()  # prefill
    for _ in range(3):
        engine.step()  # compile the decode shapes
    return llm, mesh


def workload_parser(steps: int, steps_help: str) -> argparse.ArgumentParser:
    """The options of `decoding_llm`'s workload (and --json)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--steps", type=int, default=steps, help=steps_help)
    ap.add_argument("--mesh", default=None, help="e.g. tp=2: kernel time is per device")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    ap.add_argument("--quantize", default=None, help="projections quantized: int8, int4:g128...")
    ap.add_argument("--json", default=None)
    return ap


def main():
    ap = workload_parser(12, "engine steps per measurement")
    ap.add_argument("--top", type=int, default=0, help="also list the N costliest kernels")
    ap.add_argument("--sequence", type=int, default=0,
                    help="also save the first N kernels recorded, in order, to --json")
    args = ap.parse_args()
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib  # CUPTI, as mosaic's profiler

    from jaxinfer.benchmarks.harness import measure_ceilings, weight_bytes

    llm, mesh = decoding_llm(args.preset, args.batch, args.ctx, args.decode_steps, args.steps,
                             args.mesh, page_size=args.page_size, quantize=args.quantize)
    devices = mesh.size  # CUPTI records every device's kernels: times are summed over them
    engine = llm.engine

    def run():
        return sum(len(d.token_ids) for _ in range(args.steps) for d in engine.step())

    t = time.perf_counter()
    tokens = run()
    wall = (time.perf_counter() - t) / tokens  # per generated token (all sequences)
    # CUPTI records every kernel the engine's steps launch (jax's mosaic profiler would jit
    # the function it measures, so its CUPTI hooks are called directly).
    cupti = mosaic_gpu_lib._mosaic_gpu_ext
    cupti._cupti_init()
    try:
        measured = run()
    finally:
        kernels = cupti._cupti_get_timings(True)
    busy = sum(ms for _, ms in kernels) / 1e3 / measured / devices
    copy = measure_ceilings().copy_bytes_per_s
    # weights once per step (MoE: the experts the batch hits), per token, all devices at once
    floor = weight_bytes(llm.model, tokens=args.batch) / copy / args.batch / devices
    result = {"preset": args.preset, "mesh": str(mesh.shape), "batch": args.batch,
              "ctx": args.ctx,
              "decode_steps": args.decode_steps, "wall_ms_per_token": wall * 1e3,
              "kernel_ms_per_token": busy * 1e3, "host_overhead": 1 - busy / wall,
              "weight_floor_ms_per_token": floor * 1e3, "fraction_of_floor": floor / wall,
              "copy_gb_per_s": copy / 1e9, "kernels_per_token": len(kernels) / measured,
              "kernel_sequence": [(name[:90], ms * 1e3) for name, ms in kernels[:args.sequence]]}
    print(f"B={args.batch} ctx={args.ctx} decode_steps={args.decode_steps}: "
          f"wall {wall * 1e3:.3f} ms/token, kernels {busy * 1e3:.3f} ms/token, host overhead "
          f"{100 * (1 - busy / wall):.1f}%, weight floor {floor * 1e3:.3f} ms "
          f"({100 * floor / wall:.1f}% of it reached; copy {copy / 1e9:.0f} GB/s)")
    if args.top:
        from step_profile import kernel_table  # bench/, beside this script

        print(kernel_table(kernels, args.top))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
