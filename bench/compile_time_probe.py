"""Probe: where the warm-up's compile time goes, with no cache.

    python bench/compile_time_probe.py shapes [PRESET]      a few shapes, one at a time:
        tracing and lowering (Python) against XLA's compile
    python bench/compile_time_probe.py serial [PRESET]      the serve defaults' warm-up
        programs one at a time (each one's times, and the sum)
    python bench/compile_time_probe.py threads N [PRESET]   the same on N threads, each
        tracing, lowering and compiling whole programs (as `CompiledSteps.compile_many`)
    python bench/compile_time_probe.py split N [PRESET]     every program traced and lowered
        first, on this thread, then the N threads only compile: whether XLA's compiles
        overlap once Python is out of the way

PRESET defaults to llama3-8b (serve defaults: 64 sequences, 2048 batched tokens, 4 GiB of
KV cache).
"""

import concurrent.futures
import os
import sys
import time

os.environ["JAXINFER_COMPILATION_CACHE"] = "0"  # before jaxinfer reads them
os.environ["JAXINFER_EXECUTABLE_CACHE"] = "0"

from jaxinfer.engine.compiled_steps import StepShape  # noqa: E402
from jaxinfer.engine.runner import WARMUP_CONTEXT  # noqa: E402
from jaxinfer.llm import LLM  # noqa: E402
from jaxinfer.loading import presets  # noqa: E402


def timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


def main():
    mode, rest = sys.argv[1], sys.argv[2:]
    workers = int(rest.pop(0)) if mode in ("threads", "split") else 1
    preset = rest[0] if rest else "llama3-8b"
    llm, seconds = timed(lambda: LLM(presets.random_model(presets.preset_config(preset)),
                                     kv_cache_bytes=4 << 30, max_num_seqs=64,
                                     max_num_batched_tokens=2048))
    print(f"load {seconds:.1f} s", flush=True)
    r = llm.runner
    if mode == "shapes":
        shapes = [StepShape("sample", 1, 1, 128), StepShape("sample", 64, 64, 128),
                  StepShape("sample", 2048, 64, 128)]
    else:
        shapes = r.warmup_shapes(64, 2048, 1, WARMUP_CONTEXT)
    start = time.perf_counter()

    def lower(shape):
        lowered, t = timed(r.lower, shape, *r.example_args(shape))
        return lowered, t

    def build(shape):
        lowered, t_lower = lower(shape)
        _, t_compile = timed(lowered.compile)
        return t_lower, t_compile

    if mode in ("shapes", "serial"):
        times = []
        for shape in shapes:
            times.append(build(shape))
            print(f"{shape}: trace + lower {times[-1][0]:.2f} s, compile {times[-1][1]:.2f} s",
                  flush=True)
        print(f"{len(shapes)} programs: trace + lower {sum(t for t, _ in times):.1f} s, "
              f"compile {sum(c for _, c in times):.1f} s, wall {time.perf_counter() - start:.1f} s")
    elif mode == "threads":
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            times = list(pool.map(build, shapes))
        print(f"{len(shapes)} programs on {workers} threads: wall "
              f"{time.perf_counter() - start:.1f} s (per program: trace + lower "
              f"{sum(t for t, _ in times):.1f} s, compile {sum(c for _, c in times):.1f} s in all)")
    elif mode == "split":
        lowered = [lower(s)[0] for s in shapes]
        t_lower = time.perf_counter() - start
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            compiles = list(pool.map(lambda lo: timed(lo.compile)[1], lowered))
        print(f"{len(shapes)} programs: trace + lower on one thread {t_lower:.1f} s, then "
              f"compiles on {workers} threads: wall {time.perf_counter() - start - t_lower:.1f} s "
              f"({sum(compiles):.1f} s in all)")


if __name__ == "__main__":
    main()
