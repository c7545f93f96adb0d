"""Where the host's time goes between device steps: cProfile around engine steps.

The decode workload of `host_overhead.py` (`jaxinfer.benchmarks.end_to_end.decoding_llm`:
B requests at --ctx tokens, decode shapes compiled first; its KV pool sized to the
workload), then --steps engine steps under cProfile: prints the wall time per engine step
and the costliest functions. The jitted call blocks while XLA drives the decode loop, so
`_run_sample` holds the device time; the rest is host work the GPU waits for.

    python bench/host_profile.py --preset llama3-8b --batch 64 --ctx 1152 \\
        --decode-steps 32 --steps 4
    python bench/host_profile.py --preset tiny --batch 64 --ctx 64 --decode-steps 32 \\
        --steps 20 --time-finish 20   # CPU: Engine.finish alone
"""

from __future__ import annotations

import cProfile
import pstats
import time

from jaxinfer.benchmarks.end_to_end import decoding_llm, workload_parser


def main():
    ap = workload_parser(4, "engine steps profiled", __doc__.split("\n")[0])
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--time-finish", type=int, default=0, metavar="N",
                    help="instead: time N calls of Engine.finish once their outputs are "
                    "ready (the per-token host work alone, no profiler)")
    a = ap.parse_args()
    llm, _ = decoding_llm(a.preset, a.batch, a.ctx, a.decode_steps, a.steps, a.mesh,
                          min_kv_bytes=0, page_size=a.page_size)
    engine = llm.engine
    if a.time_finish:
        finish, spent = engine.finish, []

        def timed(launched):
            launched[1].out[0].block_until_ready()
            t = time.perf_counter()
            deltas = finish(launched)
            spent.append(time.perf_counter() - t)
            return deltas

        engine.finish = timed
        for _ in range(a.time_finish):
            engine.step()
        print(f"Engine.finish: {sum(spent) / len(spent) * 1e3:.2f} ms per call "
              f"({a.batch} x {a.decode_steps} tokens)")
        return
    profile = cProfile.Profile()
    t = time.perf_counter()
    profile.enable()
    for _ in range(a.steps):
        engine.step()
    profile.disable()
    print(f"{(time.perf_counter() - t) / a.steps * 1e3:.1f} ms per engine step "
          f"(B={a.batch}, {a.decode_steps} decode steps per call, under cProfile)")
    pstats.Stats(profile).sort_stats("tottime").print_stats(a.top)


if __name__ == "__main__":
    main()
