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

    python bench/compile_time_probe.py procs N [PRESET]     the same programs split over N
        processes (each makes its runner from the weights' descriptions, no weights, and
        compiles its share on its own threads): whether compiles that one process
        serializes (Mosaic GPU's kernel cache and XLA's LLVM options are process-wide locks)
        overlap across processes
    python bench/compile_time_probe.py mosaic [PRESET]      the Mosaic GPU attention kernel
        alone, one token bucket at a time: its compile against the whole program's
    python bench/compile_time_probe.py xla [PRESET]         `serial` for a few shapes with
        the Mosaic attention kernel refused (XLA's `by_sequence` instead): the programs'
        compile without that kernel

PRESET defaults to llama3-8b (serve defaults: 64 sequences, 2048 batched tokens, 4 GiB of
KV cache). Every mode but `procs` makes the random weights first (they are not needed).
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


def abstract_runner(preset):
    """A runner of the serve defaults' shapes made from the weights' descriptions alone (as
    a compile helper makes its own: `jaxinfer.compile_helpers.runner_from`)."""
    from jaxinfer.compile_helpers import RunnerSettings, runner_from

    config = presets.preset_config(preset)
    page_bytes = 16 * config.kv_bytes_per_token(2)  # bf16 pages of 16 tokens
    return runner_from(presets.RandomWeights(config).describe(),
                       RunnerSettings((4 << 30) // page_bytes, 16,
                                      config.max_position_embeddings, 64, "bfloat16", ""))


def worker(index, count, preset):
    """`procs`: this process's share of the programs, compiled on its own threads."""
    r = abstract_runner(preset)
    shapes = r.warmup_shapes(64, 2048, 1, WARMUP_CONTEXT)[index::count]
    start = time.perf_counter()
    r.steps.compile_many(shapes)
    print(f"  process {index}: {len(shapes)} programs in {time.perf_counter() - start:.1f} s",
          flush=True)


def procs(count, preset):
    import subprocess

    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    start = time.perf_counter()
    children = [subprocess.Popen([sys.executable, __file__, "worker", str(i), str(count),
                                  preset], env=env) for i in range(count)]
    codes = [c.wait() for c in children]
    print(f"{count} processes: wall {time.perf_counter() - start:.1f} s (each importing JAX, "
          f"starting the GPU and making its runner), exit codes {codes}")


def mosaic(preset):
    """The attention kernel alone, per token bucket, serially."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.ops.attention import AttentionMetadata
    from jaxinfer.ops.attention_registry import ragged_paged_attention
    from jaxinfer.ops.kernels import import_platform_kernels

    import_platform_kernels()
    c = presets.preset_config(preset)
    bf16, i32 = jnp.bfloat16, jnp.int32
    num_pages, S, P = 16384, 64, 128
    for T in (2, 64, 2048, 64):
        sds = jax.ShapeDtypeStruct
        args = (sds((T, c.num_heads, c.head_dim), bf16), sds((T, c.num_kv_heads, c.head_dim), bf16),
                sds((T, c.num_kv_heads, c.head_dim), bf16),
                sds((num_pages, 16, c.num_kv_heads, c.head_dim), bf16),
                sds((num_pages, 16, c.num_kv_heads, c.head_dim), bf16),
                AttentionMetadata(sds((min(T, S) + 1,), i32), sds((min(T, S),), i32),
                                  sds((min(T, S), P), i32), sds((1,), i32)))
        fn = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=0.088,
                                                       implementation="mosaic_gpu"))
        lowered, t_lower = timed(fn.lower, *args)
        _, t_compile = timed(lowered.compile)
        print(f"attention alone, T {T}: trace + lower {t_lower:.2f} s, compile "
              f"{t_compile:.2f} s (the last T repeats a kernel this process compiled)",
              flush=True)


def main():
    mode, rest = sys.argv[1], sys.argv[2:]
    if mode == "worker":
        return worker(int(rest[0]), int(rest[1]), rest[2])
    workers = int(rest.pop(0)) if mode in ("threads", "split", "procs") else 1
    preset = rest[0] if rest else "llama3-8b"
    if mode == "procs":
        return procs(workers, preset)
    if mode == "mosaic":
        return mosaic(preset)
    if mode == "xla":
        from jaxinfer.ops import attention_registry

        object.__setattr__(attention_registry.REGISTRY["mosaic_gpu"], "supports",
                           lambda call: "refused (probe)")
    llm, seconds = timed(lambda: LLM(presets.random_model(presets.preset_config(preset)),
                                     kv_cache_bytes=4 << 30, max_num_seqs=64,
                                     max_num_batched_tokens=2048))
    print(f"load {seconds:.1f} s", flush=True)
    r = llm.runner
    if mode in ("shapes", "xla"):
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

    if mode in ("shapes", "serial", "xla"):
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
