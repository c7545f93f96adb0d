"""The benchmark harness: timing, the device's ceilings, roofline rows, and the parts of a
kernel table (L2-cold inputs, cells that say why they did not run). `jaxinfer bench` and
the scripts in bench/ take their kernel timings, kernel records and ceilings from here
(engine steps they time with the host clock around the step, where they run it).

Timing. `median_seconds` is device kernel time on GPUs (CUPTI through jax's Mosaic GPU
profiler: the kernels one call launches, summed, without the gaps between them) and the
host clock around a synchronised call elsewhere, or wherever asked (`device_time=False`:
what a caller waits for, launches and gaps included). `kernel_times` splits a call's
device time by kernel; `recorded_kernels` records every kernel launched inside a block of
code (engine steps: jax's profiler jits the function it measures, so it cannot wrap them).

Ceilings. `measure_ceilings` times a device-to-device copy (bytes read + written) and a bf16
matmul now, on this device; `ceilings_in_child_process` measures them in another process,
for runs that time model steps afterwards (CUPTI slows later launches in its process).

Rows. `roofline` sets one measured time against both ceilings: bytes and FLOPs moved, the %
of each ceiling reached, and the floor (the slower ceiling's time) over the time. Every
figure is a median.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

# --- timing ------------------------------------------------------------------------------------


def median_seconds(fn, *args, iters: int = 20, warmup: int = 3,
                   device_time: bool = True) -> float:
    """Median time of fn(*args) over `iters` calls after `warmup` untimed ones: device
    kernel time on a GPU (CUPTI), else host time around a call and its sync. fn may be a
    `Rotating` (each call reads other buffers)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    if device_time and jax.default_backend() == "gpu":
        from jax.experimental.mosaic.gpu import profiler

        times_ms = []
        for _ in range(iters):  # one call at a time: each output is freed before the next
            out, ms = profiler.measure(fn)(*args)
            del out
            times_ms.append(ms)
        return statistics.median(times_ms) / 1e3
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def kernel_times(fn, arg_sets: list[tuple], iters: int = 21,
                 warmup: int = 1) -> tuple[float, list[tuple[str, float]]]:
    """Device time of fn by kernel (CUPTI; GPU only): after `warmup` untimed calls, call i
    (of `iters`) runs on arg_sets[i % len(arg_sets)]. Returns (median seconds per call, all
    its kernels summed; [(kernel name, median seconds)] in launch order).

    CUPTI's `measure` runs each measured call once untimed first on the same inputs, so a
    measured call finds in L2 what fits there of the inputs it reads."""
    from jax.experimental.mosaic.gpu import profiler

    for i in range(warmup):
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
    runs = []
    for i in range(iters):
        out, per_kernel = profiler.measure(fn, aggregate=False)(*arg_sets[i % len(arg_sets)])
        del out
        runs.append(per_kernel)
    total = statistics.median(sum(ms for _, ms in run) for run in runs) / 1e3
    names = [name for name, _ in runs[0]]
    return total, [(name, statistics.median(run[k][1] for run in runs) / 1e3)
                   for k, name in enumerate(names)]


@contextlib.contextmanager
def recorded_kernels():
    """Records every kernel that runs while the block does (CUPTI, GPU only): yields a list
    that holds (kernel name, milliseconds) per launch, in order, once the block exits."""
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib  # the CUPTI hooks jax's profiler uses

    cupti = mosaic_gpu_lib._mosaic_gpu_ext
    kernels: list[tuple[str, float]] = []
    cupti._cupti_init()
    try:
        yield kernels
    finally:
        kernels.extend(cupti._cupti_get_timings(True))


@contextlib.contextmanager
def gc_pauses():
    """Yields {generation: [collections, seconds]} of the garbage collector's runs while
    inside (gc.callbacks): a collection holds the thread that drives the device."""
    import gc

    totals = collections.defaultdict(lambda: [0, 0.0])
    started = [0.0]

    def callback(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            t = totals[info["generation"]]
            t[0] += 1
            t[1] += time.perf_counter() - started[0]

    gc.callbacks.append(callback)
    try:
        yield totals
    finally:
        gc.callbacks.remove(callback)


def convert_in_child_process(source: str, dest: str, dtype: str) -> tuple[float, int]:
    """`jaxinfer.loading.checkpoint.convert(source, dest, dtype)` run by a child process, so
    that its peak memory is the conversion's alone: (wall seconds of the conversion, the
    child's peak RSS in bytes, its imports included)."""
    code = ("import sys, time, resource\n"
            "from jaxinfer.loading.checkpoint import convert\n"
            "t = time.perf_counter()\n"
            "convert(sys.argv[1], sys.argv[2], dtype=sys.argv[3], progress=False)\n"
            "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", code, source, dest, dtype], capture_output=True,
                         text=True, check=True).stdout.split()
    return float(out[0]), int(out[1]) * 1024  # ru_maxrss: KiB on Linux


def kernel_table(kernels: list[tuple[str, float]], top: int) -> str:
    """CUPTI's (name, ms) records -> a markdown table of the `top` kernels by summed time."""
    total, count = collections.Counter(), collections.Counter()
    for name, ms in kernels:
        total[name[:90]] += ms
        count[name[:90]] += 1
    busy = sum(total.values())
    lines = ["| kernel | calls | total ms | share |", "| --- | --- | --- | --- |"]
    lines += [f"| {name} | {count[name]} | {ms:.1f} | {100 * ms / busy:.1f}% |"
              for name, ms in total.most_common(top)]
    return "\n".join(lines)


# --- ceilings ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Ceilings:
    copy_bytes_per_s: float  # device-to-device copy, bytes read + written
    matmul_flops_per_s: float  # bf16 matmul through XLA

    def line(self) -> str:
        return (f"ceilings: copy {self.copy_bytes_per_s / 1e9:.1f} GB/s, "
                f"bf16 matmul {self.matmul_flops_per_s / 1e12:.2f} TFLOP/s")

    def times(self, devices: int) -> Ceilings:
        """The ceilings of `devices` such devices working together (a sharded model)."""
        return Ceilings(self.copy_bytes_per_s * devices, self.matmul_flops_per_s * devices)


def measure_ceilings(copy_bytes: int | None = None, matmul_n: int | None = None) -> Ceilings:
    """Copy bandwidth (a buffer several times the L2) and the bf16 matmul rate, measured now
    (defaults: 2 GiB and n = 8192 on a GPU, 64 MiB and n = 1024 elsewhere)."""
    gpu = jax.default_backend() == "gpu"
    copy_bytes = copy_bytes or (2 << 30 if gpu else 64 << 20)
    matmul_n = matmul_n or (8192 if gpu else 1024)
    key = jax.random.key(0)
    x = jax.random.normal(key, (copy_bytes // 2,), jnp.bfloat16)
    copy = jax.jit(lambda a: a * 2)  # one read and one write per element
    t_copy = median_seconds(copy, x)
    del x
    a = jax.random.normal(key, (matmul_n, matmul_n), jnp.bfloat16)
    b = jax.random.normal(jax.random.fold_in(key, 1), (matmul_n, matmul_n), jnp.bfloat16)
    t_mm = median_seconds(jax.jit(jnp.matmul), a, b, iters=10)
    return Ceilings(2 * copy_bytes / t_copy, 2 * matmul_n**3 / t_mm)


def ceilings_in_child_process() -> Ceilings:
    """`measure_ceilings()` run by a child process on the same device. Runs that time model
    steps afterwards take their ceilings this way: on a GPU the ceilings are timed with
    CUPTI, which leaves a cost on every later kernel launch in the process that used it
    (Llama-3-8B batch-1 decode: 5.42 ms per token after it, 5.29 without, on the same
    GPU). Call it before this process takes the device's memory."""
    code = ("import json; from jaxinfer.benchmarks.harness import measure_ceilings; "
            "print(json.dumps(vars(measure_ceilings())))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    return Ceilings(**json.loads(out.strip().splitlines()[-1]))


# --- roofline rows -----------------------------------------------------------------------------


def roofline(name: str, seconds: float, bytes_moved: float, flops: float, c: Ceilings,
             floor: float | None = None) -> dict:
    """One measured thing against both ceilings. The floor is the slower of the two unless
    given (a run of steps: the sum of each step's floor)."""
    if floor is None:
        floor = max(bytes_moved / c.copy_bytes_per_s, flops / c.matmul_flops_per_s)
    return {
        "name": name, "time_us": seconds * 1e6, "bytes": bytes_moved, "flops": flops,
        "pct_copy_bw": 100 * bytes_moved / seconds / c.copy_bytes_per_s,
        "pct_matmul": 100 * flops / seconds / c.matmul_flops_per_s,
        "floor_us": floor * 1e6, "pct_of_floor": 100 * floor / seconds,
    }


def format_rows(rows: list[dict]) -> str:
    out = ["| what | time (us) | MB moved | GFLOP | % copy BW | % bf16 matmul | floor (us) "
           "| floor / time |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        out.append(f"| {r['name']} | {r['time_us']:.1f} | {r['bytes'] / 1e6:.1f} | "
                   f"{r['flops'] / 1e9:.2f} | {r['pct_copy_bw']:.1f} | {r['pct_matmul']:.1f} | "
                   f"{r['floor_us']:.1f} | {r['pct_of_floor']:.0f}% |")
    return "\n".join(out)


# --- kernel tables -----------------------------------------------------------------------------

ROTATE_BYTES = 256 << 20  # input copies cycled per timed function: ~5x an H100's 50 MB L2
MAX_COPIES = 64


class Rotating:
    """Calls fn on each of `arg_sets` in turn, one set per call, so that a timed call reads
    buffers last touched len(arg_sets) - 1 calls ago (not from L2). It has jit's `trace` and
    `lower`, so `profiler.measure` calls it as it is instead of jitting (and freezing) it."""

    def __init__(self, fn, arg_sets):
        self.fn, self.arg_sets, self.i = fn, arg_sets, 0
        assert isinstance(self, jax.stages.Wrapped)

    def __call__(self, *_):
        self.i = (self.i + 1) % len(self.arg_sets)
        return self.fn(*self.arg_sets[self.i])

    def trace(self, *args, **kw):
        return self.fn.trace(*args, **kw)

    def lower(self, *args, **kw):
        return self.fn.lower(*args, **kw)


def copies(tree, nbytes: int) -> list:
    """tree and distinct on-device copies of it (tree holds `nbytes`), enough to cover
    ROTATE_BYTES, at most MAX_COPIES in all."""
    count = min(MAX_COPIES, max(1, math.ceil(ROTATE_BYTES / max(nbytes, 1))))
    return [tree] + [jax.tree.map(lambda a: jnp.array(a, copy=True), tree)
                     for _ in range(count - 1)]


@dataclasses.dataclass
class Cell:
    """One table cell: a time, or why there is none."""

    seconds: float | None = None
    note: str = ""  # "n/a (why)", "FAIL (why)", "skipped (...)", or a remark ("M->16")

    def text(self) -> str:
        if self.seconds is None:
            return self.note or "-"
        us = f"{self.seconds * 1e6:.1f}"
        return f"{us} ({self.note})" if self.note else us


def short(e: BaseException | str, limit: int = 70) -> str:
    """One line of an exception (or a reason), short enough for a table cell."""
    msg = (str(e).strip().splitlines() or [""])[0]
    if isinstance(e, BaseException):
        msg = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
    msg = msg.replace("|", "/")
    return msg if len(msg) <= limit else msg[:limit - 3] + "..."


def timed_cell(label: str, bench: Callable[..., float], fn, arg_sets: list[tuple],
               deadline: float = math.inf) -> Cell:
    """bench(Rotating(fn, arg_sets)) (bench: `median_seconds` with its options) as a cell,
    logged as it goes: "skipped (time budget)" once time.perf_counter() is past `deadline`,
    "n/a (error)" where fn does not lower, compile or run (SMEM, OOM, ...)."""
    if time.perf_counter() > deadline:
        return Cell(note="skipped (time budget)")
    try:
        t = bench(Rotating(fn, arg_sets))
    except Exception as e:  # noqa: BLE001  (lowering / compile / SMEM / OOM)
        print(f"    {label}: {short(e, 300)}", flush=True)
        return Cell(note=f"n/a ({short(e, 60)})")
    print(f"    {label}: {t * 1e6:.1f} us", flush=True)
    return Cell(t)


@jax.jit
def _agreement(got, want):
    """(max |got - want|, max |want|, all finite) in float32."""
    g, w = got.astype(jnp.float32), want.astype(jnp.float32)
    return jnp.max(jnp.abs(g - w)), jnp.max(jnp.abs(w)), jnp.all(jnp.isfinite(g))


def disagreement(got, want, tol: float) -> str | None:
    """None if max |got - want| <= tol * max |want| (and got is finite), else why not."""
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    err, scale, finite = (float(v) for v in _agreement(got, want))
    if not finite:
        return "non-finite output"
    if err > tol * scale:
        return f"max err {err / max(scale, 1e-30):.2g} of max|ref| > {tol:g}"
    return None
