"""Compile helpers: the warm-up's step programs compiled by other processes, then loaded
from the executable cache.

Why processes: within one process the warm-up's compiles overlap badly on a GPU. Mosaic GPU
compiles its kernels under one process-wide lock, and XLA holds a process-wide lock over
LLVM's options while it emits code. The serve defaults' 12 programs took 52.4 s on 8
threads of one process, and 34.1 s split over 4 processes, their start-up included (H200,
16 cores; bench/NOTES.md, Start-up: compiling the step programs).

A helper (`python -m jaxinfer.compile_helpers FOLDER`) starts with the server: while the
server loads the weights, it makes their abstract model from their descriptions
(`PlacedWeights.describe`, then `abstract_model`: no weights are read or made). Once the
server has planned its KV cache (which needs the loaded weights: `plan_kv_cache`) and
assigned the programs (`CompileHelpers.assign`), the helper makes the runner, compiles
programs and writes them to the executable cache (`jaxinfer.engine.compiled_steps`). The
programs are the ones this process would compile: the same runner settings give the same
cache keys. The helpers and the server take the programs from one queue, the most costly
first
(`compile_claimed`: a program is claimed by creating a file, which one process wins), so a
slow load or a slow helper shifts the work to the others. A helper that fails costs time
only, since the warm-up compiles whatever the cache lacks.

Helpers run where they pay: one process on GPUs with the executable cache on
(`helper_count`; JAXINFER_COMPILE_HELPERS=N sets their number, 0 turns them off). Each
runs with a memory pool that grows as it needs (XLA_PYTHON_CLIENT_PREALLOCATE=false), in
what the main process's pool leaves free (1 - gpu_memory_utilization): that memory, not
the host's cores, bounds their number on an 80 GB card (HELPER_DEVICE_BYTES).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxinfer.engine.compiled_steps import CompiledSteps, StepShape, executable_cache_dir
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.loading.plan import JAX_DEFAULT_MEM_FRACTION

logger = logging.getLogger(__name__)

# Host cores per helper process by default (a helper's compiles use several threads too).
CORES_PER_HELPER = 4
# Device memory a helper takes outside the main process's pool (its CUDA context and the
# copies its GEMM autotuning times kernels on): on the H100 (8 GiB outside a 0.9 pool) two
# helpers fitted, a third ran out while autotuning.
HELPER_DEVICE_BYTES = 3 * 2**30
MAX_HELPERS = 8  # started before the programs are known: at most this many
# A helper's folder: the weights' description and mesh at its start, its work later.
WEIGHTS_FILE, WORK_FILE = "weights.json", "work.json"


@dataclasses.dataclass(frozen=True)
class RunnerSettings:
    """What a `ModelRunner` is made from besides its model (JSON-able)."""

    num_pages: int
    page_size: int
    max_model_len: int
    max_num_seqs: int
    kv_dtype: str
    mesh: str  # a `MeshSpec` spelling (one replica)
    batch_invariant: bool = False


def helper_count(num_shapes: int, devices: Sequence[jax.Device]) -> int:
    """How many helper processes to start for num_shapes programs: JAXINFER_COMPILE_HELPERS
    if set, else on a GPU one per CORES_PER_HELPER host cores and per HELPER_DEVICE_BYTES of
    device memory outside JAX's pool (at most one a program), else 0 (the CPU: its cores are
    what the compiles run on anyway). 0 where the executable cache is off or the job has
    several processes."""
    if executable_cache_dir() is None or jax.process_count() > 1 or num_shapes == 0:
        return 0
    setting = os.environ.get("JAXINFER_COMPILE_HELPERS")
    if setting:
        return min(int(setting), num_shapes)
    if devices[0].platform != "gpu":
        return 0
    stats = devices[0].memory_stats() or {}
    pool = stats.get("bytes_limit", 0)
    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_DEFAULT_MEM_FRACTION))
    outside = pool / fraction - pool if pool else 0  # the device's memory beside the pool
    return min((os.cpu_count() or 1) // CORES_PER_HELPER, int(outside // HELPER_DEVICE_BYTES),
               num_shapes)


class CompileHelpers:
    """Helper processes, started at once: each makes the abstract model of `weights` and
    waits for `assign` (the runner's settings, known once the weights are loaded and the
    KV cache planned) to compile the programs; `wait()` for them, or `close()` to stop
    them."""

    def __init__(self, weights: dict, mesh: str, count: int):
        """weights: `PlacedWeights.describe()`; mesh: a `MeshSpec` spelling (one replica);
        count: processes (>= 1)."""
        self.shapes: list[StepShape] = []
        self._dir = Path(tempfile.mkdtemp(prefix="jaxinfer-compile-helpers-"))
        self.claims = self._dir / "claims"
        self.claims.mkdir()
        (self._dir / WEIGHTS_FILE).write_text(json.dumps({"weights": weights, "mesh": mesh}))
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
        self._logs = [self._dir / f"helper-{i}.log" for i in range(count)]
        self._processes = []
        for log in self._logs:
            with open(log, "wb") as out:
                self._processes.append(subprocess.Popen(
                    [sys.executable, "-m", "jaxinfer.compile_helpers", str(self._dir)], env=env,
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        # Stopped when this object goes, or the process exits, without a wait (an LLM made
        # with start_warmup that never warms up leaves no helper behind).
        self.close = weakref.finalize(self, _stop, self._processes, self._dir)

    def assign(self, settings: RunnerSettings, shapes: Sequence[StepShape]):
        """Gives the helpers their programs: `shapes` of the runner of `settings`."""
        self.shapes = list(shapes)
        work = json.dumps({"runner": dataclasses.asdict(settings),
                           "shapes": [dataclasses.astuple(s) for s in self.shapes]})
        tmp = self._dir / f".{WORK_FILE}.tmp"
        tmp.write_text(work)
        os.replace(tmp, self._dir / WORK_FILE)  # a helper reads all of it or nothing

    def compile_here(self, steps: CompiledSteps, on_done: Callable[[], None] | None = None):
        """This process's part: the programs left in the queue, compiled on its threads."""
        compile_claimed(steps, self.shapes, self.claims, CORES_PER_HELPER, on_done)

    def wait(self, on_poll: Callable[[], None] | None = None, interval: float = 0.25):
        """Waits for every helper, calling on_poll() every interval seconds meanwhile; logs
        a failed helper's last lines (its programs are then compiled by the caller)."""
        try:
            while any(p.poll() is None for p in self._processes):
                if on_poll is not None:
                    on_poll()
                time.sleep(interval)
            for p, log in zip(self._processes, self._logs, strict=True):
                if p.returncode != 0:
                    tail = log.read_text(errors="replace").strip().splitlines()[-3:]
                    logger.warning("compile helper %s exited with %s; the warm-up compiles "
                                   "its programs: %s", log.stem, p.returncode, " | ".join(tail))
        finally:
            self.close()


def _stop(processes: list[subprocess.Popen], directory: Path):
    """`CompileHelpers.close`: stops the helpers still running and removes their files."""
    for p in processes:
        if p.poll() is None:
            p.kill()
            p.wait()
    shutil.rmtree(directory, ignore_errors=True)


def compile_claimed(steps: CompiledSteps, shapes: Sequence[StepShape], claims: Path,
                    threads: int, on_done: Callable[[], None] | None = None) -> list:
    """Compiles, on `threads` threads, every shape of `shapes` that this call claims
    (creates its file in `claims`; another process or thread that created it first has
    it), the most tokens first: a long program started last would end the warm-up late.
    Returns the shapes it claimed; calls on_done() after each."""
    claimed = []

    def work():
        for shape in sorted(shapes, key=lambda s: (-s.num_tokens, s)):
            name = hashlib.sha256(repr(shape).encode()).hexdigest()[:32]
            try:
                os.close(os.open(claims / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                continue
            claimed.append(shape)
            steps.compile_many([shape])
            if on_done is not None:
                on_done()

    with concurrent.futures.ThreadPoolExecutor(threads, "compile-claimed") as pool:
        for future in [pool.submit(work) for _ in range(threads)]:
            future.result()
    return claimed


def runner_from(weights: dict, settings: RunnerSettings, model=None) -> ModelRunner:
    """The runner of `settings` for the weights `weights` describes, made from their
    descriptions only (it can compile, not run); model: their abstract model, if made."""
    from jaxinfer.loading.presets import weights_from
    from jaxinfer.sharding import MeshSpec

    mesh = MeshSpec.parse(settings.mesh).meshes()[0]
    if model is None:
        model = weights_from(weights, mesh).abstract_model()
    return ModelRunner(model, settings.num_pages, settings.page_size, settings.max_model_len,
                       mesh, settings.max_num_seqs, jnp.dtype(settings.kv_dtype),
                       weights=concurrent.futures.Future(),
                       batch_invariant=settings.batch_invariant)


def main(argv: list[str]) -> int:
    from jaxinfer.loading.presets import weights_from
    from jaxinfer.sharding import MeshSpec

    folder, parent = Path(argv[0]), os.getppid()
    spec = json.loads((folder / WEIGHTS_FILE).read_text())
    # Made while the server loads the weights and plans the KV cache.
    model = weights_from(spec["weights"], MeshSpec.parse(spec["mesh"]).meshes()[0]
                         ).abstract_model()
    while not (folder / WORK_FILE).exists():
        if os.getppid() != parent:  # the server is gone
            return 1
        time.sleep(0.02)
    work = json.loads((folder / WORK_FILE).read_text())
    runner = runner_from(spec["weights"], RunnerSettings(**work["runner"]), model)
    shapes = compile_claimed(runner.steps, [StepShape(*s) for s in work["shapes"]],
                             folder / "claims", CORES_PER_HELPER)
    # A program compiled untuned (no memory left to autotune) is kept in memory only: then
    # the warm-up compiles it, and this helper says so.
    missing = [s for s in shapes if not runner.steps.on_disk(s)]
    if missing:
        print(f"{len(missing)} of {len(shapes)} programs not written to the executable cache "
              f"(out of device memory while autotuning?): {missing}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
