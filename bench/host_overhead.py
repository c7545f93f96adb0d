"""Host overhead between device steps, from a CUPTI profile of the engine's decode steps.

B requests decode at a context of --ctx tokens; K engine steps are timed on the host
clock (what a user waits for), and K more run under CUPTI, which records every kernel
they launch. Host overhead = 1 - (kernel time per generated token / wall time per
generated token): the share of the time the GPU has no kernel to run (scheduler,
input preparation, launches, the copy of the sampled ids back). The weight floor is the
weights a decode step reads (`jaxinfer.loading.weights.step_weight_bytes`) over the copy
bandwidth, per token.

    python bench/host_overhead.py --preset llama3-8b --batch 1 --decode-steps 8
"""

from __future__ import annotations

import json
import time

from jaxinfer.benchmarks.end_to_end import decoding_llm, workload_parser
from jaxinfer.benchmarks.harness import kernel_table, measure_ceilings, recorded_kernels
from jaxinfer.loading.weights import step_weight_bytes


def main():
    ap = workload_parser(12, "engine steps per measurement", __doc__.split("\n")[0])
    ap.add_argument("--top", type=int, default=0, help="also list the N costliest kernels")
    ap.add_argument("--sequence", type=int, default=0,
                    help="also save the first N kernels recorded, in order, to --json")
    args = ap.parse_args()
    llm, mesh = decoding_llm(args.preset, args.batch, args.ctx, args.decode_steps, args.steps,
                             args.mesh, page_size=args.page_size, quantize=args.quantize)
    devices = mesh.size  # CUPTI records every device's kernels: times are summed over them
    engine = llm.engine

    def run():
        return sum(len(d.token_ids) for _ in range(args.steps) for d in engine.step())

    t = time.perf_counter()
    tokens = run()
    wall = (time.perf_counter() - t) / tokens  # per generated token (all sequences)
    with recorded_kernels() as kernels:  # every kernel the engine's steps launch
        measured = run()
    busy = sum(ms for _, ms in kernels) / 1e3 / measured / devices
    copy = measure_ceilings().copy_bytes_per_s
    # the weights a step of `batch` tokens reads, per token, all devices at once
    floor = step_weight_bytes(llm.model, args.batch) / copy / args.batch / devices
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
        print(kernel_table(kernels, args.top))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
