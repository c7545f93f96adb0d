"""The compiled programs of a model runner's step, one per static signature (`StepShape`),
made ahead of time and kept: in memory, and on disk so that the next process loads them
instead of tracing and compiling again.

A step program is a jitted function whose arguments are padded to buckets
(`jaxinfer.engine.runner`); each bucket combination is one XLA program. `CompiledSteps`
holds them: `run` executes the program of a shape (compiling it first, and counting that
as an on-demand compile, if nobody compiled it before), `compile_many` compiles a list of
shapes on a thread pool (warm-up: XLA compiles outside the GIL, so the threads' compiles
overlap; tracing does not), and `prefetch` starts one in the background (the next page
bucket of a growing sequence, before it is needed).

On disk (`$JAXINFER_CACHE/executables`, one file per program): a serialized executable
keyed by a fingerprint of everything that decides the program (jax / jaxlib versions, the
devices, the mesh, the source of the jaxinfer package, the model's parameter shapes,
dtypes and shardings, the runner's settings and the shape) and written atomically. Loading
one skips tracing and lowering, which JAX's persistent compilation cache does not (its key
is the lowered program). The files are executables written by this package into the
user's own cache directory: as trusted as JAX's compilation cache beside them, and read
from nowhere else. JAXINFER_EXECUTABLE_CACHE=0 turns the disk side off.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np

logger = logging.getLogger(__name__)

DEFAULT_MAX_CACHE_GB = 8.0


@dataclasses.dataclass(frozen=True, order=True)
class StepShape:
    """The static signature of one step program: its buckets and static options.

      kind           "sample" (forward + sampling), "logits" (forward, every row's logits)
                     or "draw" (the draw from a one-step batch's logits)
      num_tokens     T: token rows
      num_seqs       S: sequence slots
      pages_per_seq  P: page-table columns
      history        L: token-history columns (0: no penalties in the batch)
      num_steps      decode steps in one call (1: one forward)
      with_logprobs  whether the program returns logprobs
      filtered       a draw's rows (or a multi-step decode's, whose loop draws) may set top_k,
                     top_p or min_p (a vocabulary sort; without: the whole distribution, no sort)
    """

    kind: str
    num_tokens: int
    num_seqs: int
    pages_per_seq: int
    history: int = 0
    num_steps: int = 1
    with_logprobs: bool = False
    filtered: bool = False


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """Bytes a program needs on each device beyond its arguments (`CompiledSteps.memory`)."""

    temp_bytes: int  # XLA's temporaries: activations, logits, the sampler's, GEMM workspaces
    output_bytes: int  # outputs not written over a donated argument (the sampled tokens)

    @property
    def total(self) -> int:
        return self.temp_bytes + self.output_bytes


def package_fingerprint() -> str:
    """A hash of the source of the packages a step runs (jaxinfer, its models and kernels:
    every .py file), so an edited kernel or model never loads a program compiled from the
    old code. (An editable install maps them to separate folders, a wheel nests them.)"""
    import jaxinfer.models
    import jaxinfer.mosaic
    import jaxinfer.pallas_kernels

    files = {path.resolve() for package in (jaxinfer, jaxinfer.models, jaxinfer.mosaic,
                                            jaxinfer.pallas_kernels)
             for root in package.__path__ for path in Path(root).rglob("*.py")}
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def executable_cache_dir() -> Path | None:
    """Where serialized step programs live (None: the disk cache is off)."""
    from jaxinfer.loading.default_model import cache_dir

    setting = os.environ.get("JAXINFER_EXECUTABLE_CACHE", "")
    if setting == "0" or jax.process_count() > 1:  # one process's view of a multi-host job
        return None
    return Path(setting) if setting else cache_dir() / "executables"


def _environment() -> str:
    """The versions, devices and settings a compiled program depends on beyond its inputs."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        jaxlib = version("jaxlib")
    except PackageNotFoundError:
        jaxlib = ""
    devices = jax.devices()
    # XLA_PYTHON_CLIENT_* size the memory pool, which no program depends on (compile helper
    # processes run with a pool of their own: `jaxinfer.compile_helpers`).
    env = sorted((k, v) for k, v in os.environ.items()
                 if k.startswith(("JAXINFER_", "XLA_", "JAX_", "LIBTPU"))
                 and not k.startswith("XLA_PYTHON_CLIENT_"))
    return repr((jax.__version__, jaxlib, devices[0].client.platform_version,
                 [(d.id, d.device_kind) for d in devices], env))


class CompiledSteps:
    """A step's compiled programs, by `StepShape`.

    `lower(shape, *args)` traces and lowers the step for a shape (`jax.stages.Lowered`);
    `make_args(shape)` builds example arguments of that shape (only their shapes, dtypes
    and shardings matter: lowering reads nothing); `out_tree(shape)` is the structure of
    the program's output, needed to load one from disk. `identity` describes what else
    decides the program (the model's parameter shapes and shardings, the runner's
    settings).
    """

    def __init__(self, name: str, lower: Callable[..., jax.stages.Lowered],
                 make_args: Callable[[StepShape], tuple], out_tree: Callable[[StepShape], object],
                 identity: str, devices: Sequence[jax.Device], max_workers: int | None = None):
        """devices: the mesh's, in its order (a program loaded from disk runs on them)."""
        self.name, self._devices = name, list(devices)
        self._lower, self._make_args, self._out_tree = lower, make_args, out_tree
        self._programs: dict[StepShape, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_workers or max(2, min(8, os.cpu_count() or 2)),
            thread_name_prefix=f"compile-{name}")
        self._dir = executable_cache_dir()
        self._key = None
        if self._dir is not None:
            self._key = hashlib.sha256(
                (package_fingerprint() + _environment() + identity).encode()).hexdigest()
        # Counters (the server's metrics and the tests read them).
        self.num_compiled = 0  # programs traced and compiled by XLA in this process
        self.num_loaded = 0  # programs loaded from disk
        self.num_on_demand = 0  # programs a step needed before anyone had started them

    # -- public -----------------------------------------------------------------------

    def run(self, shape: StepShape, *args):
        """Runs shape's program on args (compiling or loading it first if needed)."""
        future, started = self._start(shape, background=False)
        if not started and future.done() and future.exception() is not None:
            with self._lock:  # a background compile failed: try again here, and raise
                self._programs.pop(shape, None)
            future, started = self._start(shape, background=False)
        if started or not future.done():  # compiled now, or still being compiled: a wait
            with self._lock:
                self.num_on_demand += 1
            logger.info("%s: a step waited for its program: %s", self.name, shape)
        return future.result()(*args)

    def compile_many(self, shapes: Sequence[StepShape],
                     progress: Callable[[int, int], None] | None = None):
        """Compiles (or loads) every shape (each once), on the thread pool; calls
        progress(done, total) after each. Raises the first failure."""
        futures = [self._start(s, background=True)[0] for s in sorted(set(shapes))]
        done = 0
        for f in concurrent.futures.as_completed(futures):
            f.result()
            done += 1
            if progress is not None:
                progress(done, len(futures))

    def prefetch(self, shape: StepShape):
        """Starts compiling shape in the background unless it is compiled or under way."""
        self._start(shape, background=True)

    def on_disk(self, shape: StepShape) -> bool:
        """Whether shape's program is in the executable cache (another process may have put
        it there: `jaxinfer.compile_helpers`)."""
        path = self._path(shape)
        return path is not None and path.exists()

    def memory(self, shape: StepShape) -> ProgramMemory:
        """What shape's program needs on each device beyond its arguments, from XLA's
        buffer assignment (`jax.stages.Compiled.memory_analysis`): compiled for this (not
        kept: a probe's program does not run) unless the executable cache has the figures
        from an earlier compile of the same program. On a GPU it compiles without GEMM
        autotuning, which allocates device memory (this may run while the weights load)
        and does not change the buffers (H200, Llama-3-8B at 8192 tokens: the same
        876.8 MiB either way)."""
        path = self._path(shape)
        record = None if path is None else path.with_suffix(".memory.json")
        if record is not None and record.exists():
            try:
                return ProgramMemory(**json.loads(record.read_text()))
            except (OSError, ValueError, TypeError) as e:
                logger.warning("%s: cannot read %s (%s); compiling again", self.name, record, e)
        untuned = {"xla_gpu_autotune_level": 0} if self._devices[0].platform == "gpu" else None
        analysis = self._lower(shape, *self._make_args(shape)).compile(untuned).memory_analysis()
        with self._lock:
            self.num_compiled += 1
        memory = ProgramMemory(
            temp_bytes=int(analysis.temp_size_in_bytes),
            output_bytes=int(analysis.output_size_in_bytes - analysis.alias_size_in_bytes))
        if record is not None:
            _write_atomically(record, json.dumps(dataclasses.asdict(memory)).encode())
        return memory

    def has(self, shape: StepShape) -> bool:
        """Whether shape's program exists or is being made."""
        return shape in self._programs

    def shapes(self) -> list[StepShape]:
        return sorted(self._programs)

    # -- internals --------------------------------------------------------------------

    def _start(self, shape: StepShape, background: bool):
        with self._lock:
            if shape in self._programs:
                return self._programs[shape], False
            if background:
                future = self._pool.submit(self._build, shape)
            else:
                future = concurrent.futures.Future()
            self._programs[shape] = future
        if not background:
            try:
                future.set_result(self._build(shape))
            except BaseException as e:
                with self._lock:
                    del self._programs[shape]  # a later step may try again
                future.set_exception(e)
                raise
        return future, True

    def _path(self, shape: StepShape, args: tuple | None = None) -> Path | None:
        """args: shape's example arguments, if already made."""
        if self._dir is None:
            return None
        # The arguments' shapes and dtypes too: a program runs only on those, and a setting
        # the identity omits may size one (the runner's last-token slots follow
        # max_num_seqs).
        args = self._make_args(shape) if args is None else args
        signature = repr([(np.shape(x), str(getattr(x, "dtype", type(x).__name__)))
                          for x in jax.tree.leaves(args)])
        name = hashlib.sha256((self._key + repr(shape) + signature).encode()).hexdigest()[:32]
        return self._dir / f"{self.name}-{name}.jexe"

    def _build(self, shape: StepShape):
        from jax.experimental import serialize_executable

        args = self._make_args(shape)
        in_tree = jax.tree.structure((args, {}))
        path = self._path(shape, args)
        if path is not None and path.exists():
            try:
                program = serialize_executable.deserialize_and_load(
                    path.read_bytes(), in_tree, self._out_tree(shape),
                    execution_devices=self._devices)
                os.utime(path)  # used now: the last to go when the folder is trimmed
                with self._lock:
                    self.num_loaded += 1
                return program
            except Exception as e:  # a stale or damaged file: compile it again
                logger.warning("%s: cannot load %s (%s); compiling again", self.name, path, e)
        lowered = self._lower(shape, *args)
        try:
            program = lowered.compile()
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e) or self._devices[0].platform != "gpu":
                raise
            # XLA times a GEMM's candidate kernels on fresh copies of its operands; beside an
            # allocated KV cache (a program compiled after the warm-up) that room may be
            # gone. XLA's default GEMM configurations need none. Kept in memory only, so a
            # warm-up with room compiles it tuned.
            logger.warning("%s: no memory left to autotune the GEMMs of %s; compiled "
                           "untuned, for this process (warm up before serving: "
                           "LLM.warmup)", self.name, shape)
            program = lowered.compile({"xla_gpu_autotune_level": 0})
            path = None
        with self._lock:
            self.num_compiled += 1
        if path is not None:
            self._save(path, program, in_tree, shape)
        return program

    def _save(self, path: Path, program, in_tree, shape: StepShape):
        from jax.experimental import serialize_executable

        try:
            payload, saved_in, saved_out = serialize_executable.serialize(program)
            if saved_in != in_tree or saved_out != self._out_tree(shape):
                return  # a structure this loader would not rebuild: keep it in memory only
            _write_atomically(path, payload)
            trim_cache(path.parent)
        except (OSError, ValueError, NotImplementedError) as e:
            logger.warning("%s: cannot keep the compiled step on disk (%s)", self.name, e)


def _write_atomically(path: Path, payload: bytes):
    """Writes path so that a reader sees the whole file or none."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def trim_cache(directory: Path, max_bytes: int | None = None):
    """Deletes the programs in directory used longest ago (by modification time, which a load
    renews) until the rest fit max_bytes (default: JAXINFER_EXECUTABLE_CACHE_GB GiB)."""
    if max_bytes is None:
        max_bytes = int(float(os.environ.get("JAXINFER_EXECUTABLE_CACHE_GB",
                                             DEFAULT_MAX_CACHE_GB)) * 2**30)
    files = []
    for path in directory.glob("*.jexe"):
        try:
            st = path.stat()
        except FileNotFoundError:  # another process trimmed it
            continue
        files.append((st.st_mtime, st.st_size, path))
    total = sum(size for _, size, _ in files)
    for _, size, path in sorted(files):
        if total <= max_bytes:
            return
        path.unlink(missing_ok=True)
        total -= size
