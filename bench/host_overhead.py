"""Host overhead between device steps, from a CUPTI profile of the engine's decode steps.

B requests decode at a context of --ctx tokens; K engine steps are timed on the host
clock (what a user waits for), and K more run under CUPTI, which records every kernel
they launch. Host overhead = 1 - (kernel time per generated token / wall time per
generated token): the share of the time the GPU has no kernel to run (scheduler,
input preparation, launches, the copy of the sampled ids back). The weight floor is the
weights a decode step reads (`jaxinfer.loading.weights.step_weight_bytes`) over the copy
bandwidth, per token.

    python bench/host_overhead.py --preset llama3-8b --batch 1 --decode-steps 8

--phases also times the host's share of each engine step by phase (wall clock, the engine's
methods wrapped): what the host must finish while the device runs one step, for the
overlapped steps to keep the device busy.

--kernel-config FIELD=VALUE[,...][,n=N] replaces fields of the Mosaic quantized matmul's
default `Config` in the model (for weights of N output features only, with n=N), where the
result still tiles the product: a configuration timed where the model runs it, its
neighbours fused as in a real step (the standalone sweep times XLA's kernels around the
product as kernels of their own), e.g. `--kernel-config k_splits=2,n=6144`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import os
import time

from jaxinfer.benchmarks.end_to_end import decoding_llm, workload_parser
from jaxinfer.benchmarks.harness import kernel_table, measure_ceilings, recorded_kernels
from jaxinfer.loading.weights import step_weight_bytes

# (owner, method, phase): the host's work in an engine step. The wait for the device is
# inside `finish` (collect); apply = finish less the wait.
PHASES = [("Scheduler", "schedule", "schedule"), ("ModelRunner", "prepare", "prepare inputs"),
          ("ModelRunner", "_run", "dispatch (transfers, launch)"),
          ("ModelRunner", "collect", "wait for the tokens"),
          ("Engine", "finish", "finish (wait + apply)"), ("Engine", "step", "engine step")]


@contextlib.contextmanager
def timed_phases():
    """Wraps the engine's methods of PHASES; yields {phase: total seconds} while inside."""
    from jaxinfer.engine import engine, runner, scheduler
    owners = {"Scheduler": scheduler.Scheduler, "ModelRunner": runner.ModelRunner,
              "Engine": engine.Engine}
    totals, saved = collections.defaultdict(float), []

    def timed(f, phase):
        @functools.wraps(f)
        def call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                totals[phase] += time.perf_counter() - t
        return call

    for owner, name, phase in PHASES:
        cls = owners[owner]
        raw = cls.__dict__[name]
        saved.append((cls, name, raw))
        f = raw.__func__ if isinstance(raw, staticmethod) else raw
        setattr(cls, name, staticmethod(timed(f, phase)) if isinstance(raw, staticmethod)
                else timed(f, phase))
    try:
        yield totals
    finally:
        for cls, name, raw in saved:
            setattr(cls, name, raw)


def force_kernel_config(spec: str):
    """Patches the Mosaic quantized matmul's `default_config` (see --kernel-config)."""
    from jaxinfer.mosaic import quantized_matmul as qmm

    # The executable cache's key holds JAXINFER_* variables, not patched functions: without
    # this, a run would load the step program compiled with the default config.
    os.environ["JAXINFER_BENCH_KERNEL_CONFIG"] = spec
    fields = dict(item.split("=", 1) for item in spec.split(","))
    only_n = int(fields.pop("n")) if "n" in fields else None
    defaults = qmm.Config()
    override = {name: (value.lower() in ("1", "true")) if isinstance(getattr(defaults, name), bool)
                else int(value) for name, value in fields.items()}
    default_config = qmm.default_config

    def patched(x, w):
        cfg = default_config(x, w)
        if only_n is not None and w.shape[0] != only_n:
            return cfg
        new = dataclasses.replace(cfg, **override)
        if not qmm.tiles(new, w.shape[1], qmm.piece_size(w)):
            print(f"--kernel-config: {new} does not tile {w.shape}; the default stays")
            return cfg
        return new

    qmm.default_config = patched


def main():
    ap = workload_parser(12, "engine steps per measurement", __doc__.split("\n")[0])
    ap.add_argument("--top", type=int, default=0, help="also list the N costliest kernels")
    ap.add_argument("--phases", action="store_true",
                    help="also time the host's phases of an engine step (wall clock)")
    ap.add_argument("--sequence", type=int, default=0,
                    help="also save the first N kernels recorded, in order, to --json")
    ap.add_argument("--kernel-config", default=None, metavar="FIELD=VALUE,...",
                    help="fields of the Mosaic quantized matmul's config to force (see above)")
    args = ap.parse_args()
    if args.kernel_config:
        force_kernel_config(args.kernel_config)
    llm, mesh = decoding_llm(args.preset, args.batch, args.ctx, args.decode_steps, args.steps,
                             args.mesh, page_size=args.page_size, quantize=args.quantize)
    devices = mesh.size  # CUPTI records every device's kernels: times are summed over them
    engine = llm.engine

    def run():
        return sum(len(d.token_ids) for _ in range(args.steps) for d in engine.step())

    t = time.perf_counter()
    tokens = run()
    wall = (time.perf_counter() - t) / tokens  # per generated token (all sequences)
    per_step = {}
    if args.phases:  # before CUPTI records anything: its hooks slow every launch after
        with timed_phases() as totals:
            run()
        per_step = {phase: 1e3 * seconds / args.steps for phase, seconds in totals.items()}
        per_step["apply (finish - wait)"] = (per_step.get("finish (wait + apply)", 0)
                                             - per_step.get("wait for the tokens", 0))
        per_step["host busy (step - wait)"] = (per_step.get("engine step", 0)
                                               - per_step.get("wait for the tokens", 0))
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
    if per_step:
        result["host_phases_ms_per_step"] = per_step
        print("| host phase | ms / engine step |\n| --- | --- |")
        for phase, ms in per_step.items():
            print(f"| {phase} | {ms:.3f} |")
    if args.top:
        print(kernel_table(kernels, args.top))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
