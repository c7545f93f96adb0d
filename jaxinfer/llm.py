"""The library entry point: `LLM(path).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxinfer.compile_helpers import MAX_HELPERS, CompileHelpers, RunnerSettings, helper_count
from jaxinfer.engine import multihost
from jaxinfer.engine.compiled_steps import executable_cache_dir
from jaxinfer.engine.defaults import engine_defaults
from jaxinfer.engine.engine import Engine, EngineInterface, ReplicatedEngine, heap_frozen
from jaxinfer.engine.memory_profile import StepMemory, profile_step_memory
from jaxinfer.engine.request import Request, RequestDelta, SamplingParams, TokenLogprob
from jaxinfer.engine.runner import WARMUP_CONTEXT, ModelRunner
from jaxinfer.errors import JaxinferError
from jaxinfer.loading.checkpoint import (
    ConvertedCheckpoint,
    PlacedWeights,
    is_converted,
    load_model,
    open_source,
    shard_model,
)
from jaxinfer.loading.default_model import cache_dir, default_model_path
from jaxinfer.loading.plan import (
    DEFAULT_MEMORY_UTILIZATION,
    plan_kv_cache,
    set_memory_utilization,
)
from jaxinfer.loading.tokenizer import Tokenizer
from jaxinfer.models import Decoder
from jaxinfer.models.decoder import scan_layers as scan_layers_of
from jaxinfer.ops.attention import FP8_KV_DTYPE
from jaxinfer.sharding import MeshSpec

MAX_PAGE_SIZE = 64  # the Mosaic attention kernel's smallest KV block (head_dim > 128)


@dataclasses.dataclass
class RequestOutput:
    prompt: str | list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None


def enable_compilation_cache():
    """Turns on JAX's persistent compilation cache (default $JAXINFER_CACHE/xla, or
    ~/.cache/jaxinfer/xla) where the executable cache (`executable_cache_dir`) is off, so a
    restart skips the compiles; JAXINFER_COMPILATION_CACHE=0 keeps it off, a path turns it
    on there in any case. An already configured cache directory is kept. Why not both: the
    executable cache keeps the step programs (the only ones that take seconds to compile)
    whole, and JAX's cache beside it stored each one again, which made the warm-up from
    empty caches slower by a third (bench/NOTES.md, Start-up: compiling the step programs:
    JAX's compilation cache beside the executable cache)."""
    setting = os.environ.get("JAXINFER_COMPILATION_CACHE", "")
    if setting == "0" or jax.config.jax_compilation_cache_dir:
        return
    if not setting and executable_cache_dir() is not None:
        return
    jax.config.update("jax_compilation_cache_dir", setting or str(cache_dir() / "xla"))


KV_CACHE_DTYPES = ("auto", "fp8")


def kv_cache_dtype_of(name: str, model_dtype) -> jnp.dtype:
    """The KV pages' dtype for `--kv-cache-dtype` name: "auto" is the model's, "fp8"
    float8_e4m3fn."""
    if name not in KV_CACHE_DTYPES:
        raise JaxinferError(f"kv_cache_dtype {name!r}: expected one of "
                            f"{', '.join(KV_CACHE_DTYPES)}")
    return jnp.dtype(model_dtype) if name == "auto" else jnp.dtype(FP8_KV_DTYPE)


def default_scan_layers() -> bool:
    """Whether `LLM(scan_layers=None)` scans the layers: JAXINFER_SCAN_LAYERS=1 / 0, off when
    unset. Why off: a scanned step compiles in half the time or less, but XLA copies each
    layer's slice of the stacked weights before its products, which costs decode speed on
    the CPU and the GPU alike (bench/NOTES.md, Start-up: compiling the step programs)."""
    return os.environ.get("JAXINFER_SCAN_LAYERS", "0") not in ("", "0")


def _in_thread(fn, *args) -> concurrent.futures.Future:
    """fn(*args) on a thread of its own."""
    pool = concurrent.futures.ThreadPoolExecutor(1, fn.__name__)
    try:
        return pool.submit(fn, *args)
    finally:
        pool.shutdown(wait=False)


class LLM:
    """Loads a model (converted dir, HF dir or .gguf; None = the embedded SmolLM2) and generates.

    A `Decoder` is run as it is given: one from `load_model` or `presets.random_model` is in
    its inference form (`models.inference_form`: norm scales folded into the float
    projections); one constructed directly keeps plain norms (the same function, HF's
    rounding).

    kv_cache_bytes sizes the paged KV cache; None plans it (`plan_kv_cache`): on a GPU or
    TPU, gpu_memory_utilization of each device's memory less the weights and a step's
    reserve, which must hold one sequence of max_model_len (else a one-line error with the
    figures); on the CPU, what max_num_seqs sequences of max_model_len need, at most 1 GiB.
    max_model_len defaults to the model's context, capped by what a given kv_cache_bytes
    holds; decode_steps > 1 runs that many decode steps per host round trip when every
    running request is decoding. max_num_seqs, max_num_batched_tokens and decode_steps
    default to the platform's `jaxinfer.engine.defaults` (256 sequences and 2048 tokens a
    step on GPUs and TPUs).
    """

    engine: EngineInterface  # an Engine, or a ReplicatedEngine for dp replicas

    def __init__(self, model: str | Path | Decoder | None = None, *, dtype: str | None = None,
                 page_size: int = 16, kv_cache_bytes: int | None = None,
                 max_model_len: int | None = None, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, decode_steps: int | None = None,
                 mesh: str | MeshSpec | None = None, scan_layers: bool | None = None,
                 gpu_memory_utilization: float = DEFAULT_MEMORY_UTILIZATION,
                 kv_cache_dtype: str = "auto", start_warmup: bool = False,
                 batch_invariant: bool = False):
        """`mesh` (e.g. "tp=2" or "tp=2,dp=2", see `jaxinfer.sharding`) splits the model over
        that many devices (all processes' devices, multi-host); kv_cache_bytes is per replica
        and counts every device's share. `scan_layers` runs the layers as a scan over
        stacked weights (`jaxinfer.models.decoder.scan_layers`): each step program compiles
        one group of layers instead of all of them (None: `default_scan_layers()`).
        `kv_cache_dtype`: "auto" (the model's dtype) or "fp8" (float8_e4m3fn pages, vLLM's
        fp8 KV cache with scale 1: half the bytes of bf16 a token). `start_warmup`: a
        `warmup()` follows, so its helper processes start now where they pay
        (`jaxinfer.compile_helpers`: one process on GPUs), and compile once the KV cache
        is planned.
        `batch_invariant`: each request's tokens and logprobs are bitwise the same whatever
        shares its batch (`jaxinfer.ops.registry.batch_invariant_mode`; slower: every
        product runs in blocks of fixed rows); CPUs, and GPUs for dense models, so far."""
        if not (1 <= page_size <= MAX_PAGE_SIZE and page_size & (page_size - 1) == 0):
            raise JaxinferError(f"page_size {page_size}: a power of two up to {MAX_PAGE_SIZE} "
                                "required (the attention kernels' KV blocks hold whole pages)")
        enable_compilation_cache()
        set_memory_utilization(gpu_memory_utilization)  # if JAX has not started yet
        spec = mesh if isinstance(mesh, MeshSpec) else MeshSpec.parse(mesh)
        meshes = spec.meshes()
        defaults = engine_defaults(meshes[0].devices.flat[0].platform)
        max_num_seqs = max_num_seqs or defaults.max_num_seqs
        max_num_batched_tokens = max_num_batched_tokens or defaults.max_num_batched_tokens
        decode_steps = decode_steps or defaults.decode_steps
        scan = default_scan_layers() if scan_layers is None else scan_layers
        self._model = self._weights = self._abstract_model = None
        # Weights described before they exist may load while the programs compile.
        weights = tokenizer = step_probe = None
        self._helpers: CompileHelpers | None = None

        def probe_step(model) -> StepMemory:  # what a step needs on an accelerator
            return profile_step_memory(
                model, meshes[0], page_size=page_size,
                max_model_len=max_model_len or model.config.max_position_embeddings,
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                decode_steps=decode_steps, batch_invariant=batch_invariant,
                kv_dtype=kv_cache_dtype_of(kv_cache_dtype, model.embed.embedding.dtype))

        if isinstance(model, Decoder):  # built by the caller
            self.path, self.tokenizer = None, None
            self.model = shard_model(model, meshes[0])
        elif isinstance(model, PlacedWeights):  # e.g. a random-weight preset's
            self.path, self.tokenizer, weights = None, None, model
            if model.placer.mesh != meshes[0]:
                raise JaxinferError(f"the weights were placed on {model.placer.mesh.shape}, "
                                    f"the LLM's mesh is {meshes[0].shape}")
        else:
            if model is None:
                model = default_model_path()
            self.path, files = Path(model), None
            if is_converted(self.path):
                if (self.path / "tokenizer.json").exists():  # read meanwhile
                    reader = concurrent.futures.ThreadPoolExecutor(1, "read-tokenizer")
                    tokenizer = reader.submit(Tokenizer.from_dir, self.path)
                    reader.shutdown(wait=False)
                weights = ConvertedCheckpoint(self.path, dtype, meshes[0])
            else:  # one read of the source for both weights and tokenizer
                source = open_source(self.path)
                self.model = load_model(source, dtype=dtype, mesh=meshes[0])
                files = source.tokenizer_files()
            if files and "tokenizer.json" in files:
                self.tokenizer = Tokenizer.from_files(files, self.path)
            else:
                self.tokenizer = None  # token-id prompts only (or read below)
        if weights is not None:
            one_replica = len(meshes) == 1 and not scan and jax.process_count() == 1
            helpers = (helper_count(MAX_HELPERS, meshes[0].devices.flat)
                       if start_warmup and one_replica else 0)
            if one_replica and meshes[0].devices.flat[0].platform == "cpu" and not helpers:
                # The weights load (or are made) in the background, the runner makes its
                # programs from their descriptions meanwhile (`ModelRunner`'s `weights`).
                # The load does not wait for the KV cache's plan (nor does vLLM's): a plan
                # that fails raises at once, and the load ends unused. On the CPU only: on
                # the H200 it made serve's start slower and its first step ran out of memory
                # (bench/NOTES.md, Start-up, Tried: the weights loading in the background);
                # there the compile helpers overlap the load instead.
                self._weights = weights.load_in_background()
                self._abstract_model = weights.abstract_model()
            else:
                # An accelerator plans its KV cache from what the loaded weights leave
                # (`plan_kv_cache`). Meanwhile the compile helpers start (they make the
                # abstract model, then wait for their programs: `CompileHelpers.assign`),
                # and a step's memory is measured from the weights' descriptions.
                if helpers:
                    self._helpers = CompileHelpers(weights.describe(), str(spec), helpers)
                if kv_cache_bytes is None and not scan:
                    step_probe = _in_thread(probe_step, weights.abstract_model())
                try:
                    self.model = weights.load()
                except BaseException:
                    if self._helpers is not None:
                        self._helpers.close()
                    raise
        if tokenizer is not None:
            self.tokenizer = tokenizer.result()
        model = self._abstract_model or self.model  # its shapes decide what follows
        self.config = c = model.config
        if batch_invariant:
            if meshes[0].devices.flat[0].platform == "tpu":
                raise JaxinferError("batch_invariant: CPUs and GPUs only so far (the TPU "
                                    "kernels are not batch-invariant yet)")
            if c.is_moe and meshes[0].devices.flat[0].platform != "cpu":
                raise JaxinferError("batch_invariant: MoE models on the CPU only so far (the "
                                    "GPU's grouped products in fixed blocks are not measured)")
            if decode_steps > 1:
                raise JaxinferError(f"batch_invariant: decode_steps {decode_steps}: 1 only "
                                    "so far (a multi-step decode has a row per sequence slot, "
                                    "not the mode's fixed row counts)")
        kv_dtype = kv_cache_dtype_of(kv_cache_dtype, model.embed.embedding.dtype)
        self.kv_plan = None  # the plan, where the cache was planned
        if kv_cache_bytes is None:
            def measure_step() -> tuple[int, str]:
                step = step_probe.result() if step_probe is not None else probe_step(model)
                return step.bytes, f"{step.shape}"

            self.kv_plan = plan_kv_cache(
                model, meshes[0], page_size=page_size, max_model_len=max_model_len,
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                memory_utilization=gpu_memory_utilization, name=str(self.path or "the model"),
                kv_dtype=kv_dtype,
                # A scanned model's programs are made after the plan, from another form.
                measure_step=None if scan else measure_step)
            num_pages = self.kv_plan.num_pages
        else:  # bytes of a page: every device's share of it
            page_bytes = page_size * c.kv_bytes_per_token(kv_dtype.itemsize)
            num_pages = max(kv_cache_bytes // page_bytes, 1)
        self.max_model_len = min(max_model_len or c.max_position_embeddings,
                                 num_pages * page_size)
        # dp replicas: copies of replica 0's weights, each on its own mesh.
        models = [model] + [shard_model(model, m) for m in meshes[1:]]
        if scan:
            for model_i in models:
                scan_layers_of(model_i)
        engines = []
        for model_i, replica_mesh in zip(models, meshes, strict=True):
            runner = ModelRunner(model_i, num_pages, page_size, self.max_model_len,
                                 replica_mesh, max_num_seqs, kv_dtype, self._weights,
                                 batch_invariant)
            # The next step planned while one runs. A multi-host job's followers run the
            # broadcast steps in the leader's order, each taking its decodes' tokens from
            # its own copy of the step before's output (`ModelRunner.follow`).
            engines.append(Engine(runner, c.eos_token_ids, self.max_model_len, max_num_seqs,
                                  max_num_batched_tokens, self.tokenizer, decode_steps,
                                  overlap=True))
        self.engine = engines[0] if len(engines) == 1 else ReplicatedEngine(engines)
        if self._helpers is not None:  # the warm-up's programs the executable cache lacks
            runner = self.runner
            self._helpers.assign(
                RunnerSettings(num_pages, page_size, self.max_model_len, max_num_seqs,
                               kv_dtype.name, str(spec), batch_invariant),
                [s for s in self._warmup_plans(None)[0][1] if not runner.steps.on_disk(s)])

    def _warmup_plans(self, max_len: int | None) -> list[tuple[ModelRunner, list]]:
        """(runner, its warm-up shapes) per replica for contexts up to max_len (`warmup`)."""
        e = self.engine
        max_len = min(max_len or min(self.max_model_len, WARMUP_CONTEXT), self.max_model_len)
        return [(r, r.warmup_shapes(e.max_num_seqs, e.max_num_batched_tokens, e.decode_steps,
                                    max_len)) for r in e.runners]

    def warmup(self, max_len: int | None = None, progress: bool = True,
               on_progress: Callable[[int, int], None] | None = None) -> float:
        """Compiles (or loads from the executable cache) the programs of
        `ModelRunner.warmup_shapes` for contexts up to max_len tokens (default:
        max_model_len, capped at WARMUP_CONTEXT: 2048), on a thread pool; a tqdm bar if
        progress, and on_progress(done, total) after each program. Returns the seconds it
        took."""
        from tqdm import tqdm

        start = time.perf_counter()
        plans = self._warmup_plans(max_len)
        total = sum(len(shapes) for _, shapes in plans)
        bar = tqdm(total=total, desc="warm-up: compiling", unit="program", disable=not progress)
        shown = 0
        if on_progress is not None:
            on_progress(0, total)

        def show(done: int):
            nonlocal shown
            if done > shown:
                bar.update(done - shown)
                shown = done
                if on_progress is not None:
                    on_progress(done, total)

        made = 0

        def advance(*_):
            nonlocal made
            made += 1
            show(made)

        with bar:
            if self._helpers is not None:  # programs counted as they reach the disk
                helpers, self._helpers = self._helpers, None
                runner, shapes = plans[0]

                def on_disk(*_):
                    show(sum(map(runner.steps.on_disk, shapes)))

                helpers.compile_here(runner.steps, on_disk)
                helpers.wait(on_disk)
            for runner, shapes in plans:
                if multihost.is_multiprocess():  # followers compile as they run the steps
                    for shape in shapes:
                        runner.run_empty(shape)
                        advance()
                else:
                    runner.steps.compile_many(shapes, advance)
                runner.allocate_kv_cache()  # now, after the compiles' GEMM autotuning
        self.model  # noqa: B018  (ready means loaded: a failed load raises here)
        return time.perf_counter() - start

    @property
    def model(self) -> Decoder:
        """The (first replica's) model, once its weights have loaded."""
        if self._model is None:
            self._model = self._weights.result()
        return self._model

    @model.setter
    def model(self, model: Decoder):
        self._model = model

    @property
    def runner(self) -> ModelRunner:
        """The (first replica's) model runner."""
        return self.engine.runners[0]

    def follow(self) -> list:
        """Processes other than 0 of a multi-host job: run the steps process 0 broadcasts
        until it exits (see `jaxinfer.engine.multihost`); returns each step's sampled tokens."""
        return self.runner.follow()

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return list(prompt)
        if self.tokenizer is None:
            raise JaxinferError(f"{self.path or 'the model'}: no tokenizer, so prompts must be "
                                "token ids")
        return self.tokenizer.encode(prompt)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """prompts: a string, a list of strings, or a list of token-id lists; params: one
        SamplingParams for all, or one per prompt (as in vLLM)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise JaxinferError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        requests = []
        try:
            for p, sp in zip(prompts, params, strict=True):
                requests.append(self.engine.add_request(self._prompt_ids(p), sp))
            with heap_frozen():
                while self.engine.has_unfinished():
                    self.engine.step()
        except BaseException:
            for r in requests:
                self.engine.abort(r)
            raise
        return [self._output(p, r) for p, r in zip(prompts, requests, strict=True)]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None
               ) -> Iterator[str]:
        """Returns an iterator of text deltas for one prompt (the prompt is checked now)."""
        return self._texts(self.stream_request(prompt, params)[1])

    def stream_request(self, prompt: str | list[int], params: SamplingParams | None = None
                       ) -> tuple[Request, Iterator[RequestDelta]]:
        """`stream` for a caller that needs more than the text: the Request (its
        finish_reason, output_ids and logprobs are final once the iterator is done) and an
        iterator of its RequestDeltas, one per step that added tokens (text or not). The
        prompt is checked now; closing the iterator once it has begun aborts the request."""
        req = self.engine.add_request(self._prompt_ids(prompt), params or SamplingParams())

        def deltas() -> Iterator[RequestDelta]:
            try:
                while not req.finished:
                    for delta in self.engine.step():
                        if delta.request is req:
                            yield delta
            finally:
                self.engine.abort(req)

        return req, deltas()

    @staticmethod
    def _texts(deltas: Iterator[RequestDelta]) -> Iterator[str]:
        with contextlib.closing(deltas):  # closing the texts aborts the request
            for delta in deltas:
                if delta.text:
                    yield delta.text

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Token ids of messages rendered with the checkpoint's chat template."""
        if self.tokenizer is None:
            raise JaxinferError(f"{self.path or 'the model'}: no tokenizer, so no chat template")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def logits(self, prompts: list[list[int]]) -> list:
        """float32 logits [len(prompt), vocab] for every position of each prompt (one prefill)."""
        return self.engine.logits(prompts)

    def _output(self, prompt, req: Request) -> RequestOutput:
        return RequestOutput(prompt, req.text, list(req.output_ids), req.finish_reason,
                             req.stop_reason, req.logprobs)
