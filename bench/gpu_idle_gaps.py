"""Where the GPU sits idle during decode: a jax.profiler trace of a few engine steps (the
decode workload of bench/host_overhead.py, `jaxinfer.benchmarks.end_to_end.decoding_llm`),
read back with jax.profiler.ProfileData. Prints the GPU's busy and idle time inside the
traced steps, the idle time split by gap length, and the longest gaps with the kernels
around them and the host work (XLA runtime annotations) running while the GPU waited.

    python bench/gpu_idle_gaps.py --preset llama3-8b --batch 1 --decode-steps 8

With --arrivals N, N prompts of --prompt-len tokens (asking for one token each) arrive
before every step, so each traced step prefills them beside the decodes (the throughput
run's steps with a prompt chunk, as bench/mixed_step.py runs them):

    python bench/gpu_idle_gaps.py --batch 240 --ctx 384 --decode-steps 1 --arrivals 7
"""

from __future__ import annotations

import collections
import glob
import json
import tempfile

import jax
import numpy as np
from jax.profiler import ProfileData

from jaxinfer import SamplingParams
from jaxinfer.benchmarks.end_to_end import decoding_llm, workload_parser


def device_events(planes, device: str = "/device:GPU:0"):
    """[(start_ns, end_ns, name)] of every kernel / copy on the device's streams, by start."""
    out = []
    for plane in planes:
        if plane.name != device:
            continue
        for line in plane.lines:
            if line.name.startswith("Stream"):
                out += [(e.start_ns, e.end_ns, e.name) for e in line.events]
    return sorted(out)


def host_events(planes):
    """[(start_ns, end_ns, name)] of every annotation on the host threads."""
    return [(e.start_ns, e.end_ns, e.name) for plane in planes if plane.name == "/host:CPU"
            for line in plane.lines for e in line.events]


def gaps(events, lo: float, hi: float):
    """Idle intervals of the device inside [lo, hi]: [(start, end, kernel before, after)]."""
    out, busy_until, before = [], lo, "(start)"
    for start, end, name in events:
        if end <= lo or start >= hi:
            continue
        if start > busy_until:
            out.append((busy_until, start, before, name))
        if end > busy_until:
            busy_until, before = end, name
    if busy_until < hi:
        out.append((busy_until, hi, before, "(end)"))
    return out


def main():
    ap = workload_parser(4, "engine steps traced", __doc__.split("\n")[0])
    ap.add_argument("--top", type=int, default=12, help="longest gaps listed")
    ap.add_argument("--no-overlap", action="store_true",
                    help="synchronous engine steps (the next one planned after this one)")
    ap.add_argument("--arrivals", type=int, default=0, help="prompts arriving before each step")
    ap.add_argument("--prompt-len", type=int, default=256, help="each arriving prompt")
    args = ap.parse_args()
    llm, _ = decoding_llm(args.preset, args.batch, args.ctx, args.decode_steps, args.steps,
                          args.mesh, page_size=args.page_size, extra_seqs=args.arrivals)
    llm.engine.overlap = llm.engine.overlap and not args.no_overlap
    rng = np.random.default_rng(0)
    once = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def step():
        for _ in range(args.arrivals):  # random ids: no prefix-cache hits between prompts
            llm.engine.add_request(
                rng.integers(2, llm.config.vocab_size, args.prompt_len).tolist(), once)
        llm.engine.step()

    for _ in range(6 if args.arrivals else 0):
        step()  # compile the shapes with prompt chunks, fill the pipeline
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # the Python tracer's own cost would widen the gaps
    options.host_tracer_level = 2  # XLA runtime annotations (executions, thunks, copies)
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, profiler_options=options):
            for _ in range(args.steps):
                with jax.profiler.TraceAnnotation("engine_step"):
                    step()
        path = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))[-1]
        planes = list(ProfileData.from_file(path).planes)
    steps = sorted((s, e) for s, e, n in host_events(planes) if n == "engine_step")
    lo, hi = steps[0][0], steps[-1][1]
    events = device_events(planes)
    idle = gaps(events, lo, hi)
    window = (hi - lo) / 1e3  # us
    idle_us = sum(e - s for s, e, *_ in idle) / 1e3
    by_length = collections.Counter()
    for s, e, *_ in idle:
        us = (e - s) / 1e3
        key = ("< 2 us" if us < 2 else "2-10 us" if us < 10 else "10-100 us" if us < 100
               else ">= 100 us")
        by_length[key] += us
    host = host_events(planes)
    print(f"{len(steps)} engine steps, {window / 1e3:.2f} ms; GPU busy "
          f"{window - idle_us:.0f} us, idle {idle_us:.0f} us ({100 * idle_us / window:.1f}%) "
          f"in {len(idle)} gaps; {len(events)} device events")
    # XLA re-records a CUDA graph whose buffers moved since its last run, on the host,
    # between the program's kernels: the GPU waits if it drained the queue meanwhile.
    updates = [(e - s) / 1e3 for s, e, n in host if n == "command_buffer::update"
               and lo <= s <= hi]
    print(f"command-buffer updates: {len(updates)}, {sum(updates):.0f} us of host time "
          f"(longest {max(updates, default=0):.0f} us)")
    print("idle by gap length: " + ", ".join(
        f"{k} {v:.0f} us" for k, v in sorted(by_length.items(), key=lambda kv: -kv[1])))
    print("| gap (us) | at (us from first step) | before | after | host work then |")
    print("| --- | --- | --- | --- | --- |")
    longest = sorted(idle, key=lambda g: g[0] - g[1])[:args.top]
    rows = []
    for s, e, before, after in sorted(longest):
        mid = (s + e) / 2
        during = sorted({n for hs, he, n in host if hs <= mid <= he and n != "engine_step"},
                        key=len)[:4]
        rows.append({"gap_us": (e - s) / 1e3, "at_us": (s - lo) / 1e3, "before": before,
                     "after": after, "host": during})
        print(f"| {(e - s) / 1e3:.1f} | {(s - lo) / 1e3:.0f} | {before[:40]} | {after[:40]} | "
              f"{'; '.join(d[:50] for d in during)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"window_us": window, "idle_us": idle_us, "gaps": len(idle),
                       "command_buffer_updates_us": updates,
                       "by_length_us": dict(by_length), "longest": rows}, f, indent=2)


if __name__ == "__main__":
    main()
