"""The engine: a request's life cycle, from `add_request` to its last `RequestDelta`.

`Engine` ties one model replica's scheduler (`jaxinfer.engine.scheduler`: what each step
runs), model runner (`jaxinfer.engine.runner`: the step on the device) and output side
(`jaxinfer.engine.output`: stops, text, logprobs). A step is `launch` (schedule a batch and
dispatch it) then `finish` (wait for its tokens and apply them to the requests).

With `overlap` (vLLM's async scheduling), `step` launches the next batch before it
finishes the current one, so the host's work for a step (scheduling, its inputs, reading
back and applying the tokens) runs while the device computes the one before: the next
batch's decodes take their input tokens from the running step's output on the device
(`SeqChunk.prev_row`). A request that the running step ends by EOS or a stop string runs
one more token in the next batch, dropped when that batch finishes.
`ReplicatedEngine` runs data-parallel replicas behind the same `EngineInterface`.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import gc
import itertools
from collections.abc import Iterator, Sequence

import numpy as np

from jaxinfer.engine import output
from jaxinfer.engine.request import Request, RequestDelta, SamplingParams
from jaxinfer.engine.runner import ModelRunner, PendingStep
from jaxinfer.engine.scheduler import PENDING_TOKEN, Scheduler, SeqChunk
from jaxinfer.errors import JaxinferError
from jaxinfer.loading.tokenizer import Tokenizer

# The garbage collector's thresholds while an engine runs (`heap_frozen`): a young-generation
# collection every 50,000 allocations, not every 700, and the older generations' far rarer.
# With Python's defaults a throughput run (Llama-3-8B, 512 requests, 256 decodes a step,
# H200) collected 1,017 times, 0.47-0.61 s of a 6.7-8.2 s run, on the thread that drives
# the device. On the CPU (the tiny model, 512 requests) 104 of 134 ms were the 30
# collections of the older generations, which walk the objects that live a few steps; at
# these thresholds 37 ms, none of them. The young collections' total follows the
# allocations and stays; each holds the thread for ~10 ms instead of ~0.1, where an older
# one held it for 1-100 ms. (Python servers commonly raise the first threshold so.)
RUNNING_GC_THRESHOLDS = (50_000, 50, 100)


@contextlib.contextmanager
def heap_frozen():
    """While inside: the objects alive on entry (the model's tree, the programs, jax's
    caches) are out of the garbage collector's sight (gc.freeze, as vLLM does once its
    engine is up), and the collector runs at `RUNNING_GC_THRESHOLDS`. A full collection
    walks every tracked object: with these it held the thread that drives the device for
    ~0.1 s every few hundred steps. Objects made inside are collected as usual; on exit
    every object is again (gc.unfreeze), at the thresholds there were before, so an engine
    dropped later is collected too."""
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(*RUNNING_GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


# A dispatched batch: its requests and chunks, and the runner's pending step.
Launched = tuple[list[tuple[Request, SeqChunk]], PendingStep]


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """An engine's queues, KV pages and counters at one moment (summed over dp replicas):
    what the server's metrics and the benchmarks read."""

    num_waiting: int = 0  # requests queued: not yet admitted, or preempted
    num_running: int = 0
    num_pages: int = 0  # of the KV page pool
    num_free_pages: int = 0
    num_steps: int = 0  # batches run (benchmarks divide time by it)
    num_preemptions: int = 0
    prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache at admission
    prefix_hit_tokens: int = 0  # ... and found there
    num_computed_tokens: int = 0  # tokens run through the model (prefill + decode)
    num_generated_tokens: int = 0  # output tokens kept
    num_programs_compiled: int = 0  # step programs traced and compiled in this process
    num_programs_loaded: int = 0  # ... loaded from the executable cache
    num_compiled_on_demand: int = 0  # ... that a step needed before any warm-up made them

    def __add__(self, other: EngineStats) -> EngineStats:
        return EngineStats(*(getattr(self, f.name) + getattr(other, f.name)
                             for f in dataclasses.fields(EngineStats)))


class EngineInterface(abc.ABC):
    """What the library (`LLM`), the server and the benchmarks use of an engine, whether one
    model replica (`Engine`) or several (`ReplicatedEngine`). Not thread-safe: one thread
    drives it (`validate` alone may be called from any thread)."""

    # Limits, the same on every replica.
    max_model_len: int  # tokens of a request, prompt and output
    max_num_seqs: int  # running requests per replica
    max_num_batched_tokens: int  # tokens per step and replica
    decode_steps: int  # decode steps per device call, when every running request decodes

    @property
    @abc.abstractmethod
    def runners(self) -> list[ModelRunner]:
        """Every replica's model runner (warm-up compiles each)."""

    @abc.abstractmethod
    def validate(self, prompt_ids: list[int], params: SamplingParams):
        """Raises JaxinferError (one line) for a request the engine cannot take."""

    @abc.abstractmethod
    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        """Validates and queues a request."""

    @abc.abstractmethod
    def step(self) -> list[RequestDelta]:
        """Runs one batch (on every replica); returns a delta per request that gained tokens
        or finished."""

    @abc.abstractmethod
    def abort(self, req: Request):
        """Drops req wherever it is (a no-op for one already finished); its pages are freed."""

    @abc.abstractmethod
    def has_unfinished(self) -> bool:
        """Whether any request waits or runs."""

    @property
    @abc.abstractmethod
    def waiting(self) -> Sequence[Request]:
        """The queued requests (not yet admitted, or preempted), in admission order."""

    @property
    @abc.abstractmethod
    def running(self) -> Sequence[Request]:
        """The admitted requests (they hold KV pages)."""

    @property
    @abc.abstractmethod
    def last_batch(self) -> list[tuple[Request, SeqChunk]]:
        """What the last step ran (on every replica)."""

    @abc.abstractmethod
    def stats(self) -> EngineStats:
        """The queues, pages and counters now."""

    @abc.abstractmethod
    def logits(self, prompts: list[list[int]]) -> list[np.ndarray]:
        """float32 logits [len(prompt), vocab] for every position of each prompt (one prefill
        outside the schedule, on pages borrowed from the pool)."""


class Engine(EngineInterface):
    """One model replica: its scheduler, its runner and the requests' output."""

    def __init__(self, runner: ModelRunner, eos_token_ids, max_model_len: int,
                 max_num_seqs: int = 8, max_num_batched_tokens: int = 512,
                 tokenizer: Tokenizer | None = None, decode_steps: int = 1,
                 overlap: bool = False):
        """overlap: `step` plans and launches the next batch while the current one runs
        (see the module doc), where it can: one decode step a call (decode_steps 1) and no
        penalties in the running or waiting requests (their token history would lack the
        tokens still on the device)."""
        if min(max_num_seqs, max_num_batched_tokens, decode_steps) < 1:
            raise JaxinferError(f"max_num_seqs={max_num_seqs}, max_num_batched_tokens="
                                f"{max_num_batched_tokens} and decode_steps={decode_steps} "
                                "must all be >= 1")
        self.runner = runner
        self.tokenizer = tokenizer
        self.decode_steps = decode_steps
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.scheduler = Scheduler(runner.num_pages, runner.page_size, max_model_len,
                                   max_num_seqs, max_num_batched_tokens, decode_steps)
        # Request ids, also the default seeds; dp replicas share one sequence (ReplicatedEngine).
        self.request_ids: Iterator[int] = itertools.count()
        self.num_steps = 0
        self.num_computed_tokens = 0
        self.num_generated_tokens = 0
        self._last_batch: list[tuple[Request, SeqChunk]] = []
        self.overlap = overlap and decode_steps == 1
        self._ahead: Launched | None = None  # launched, to finish at the next step

    @property
    def runners(self) -> list[ModelRunner]:
        return [self.runner]

    @property
    def waiting(self) -> Sequence[Request]:
        return self.scheduler.waiting

    @property
    def running(self) -> Sequence[Request]:
        return self.scheduler.running

    @property
    def last_batch(self) -> list[tuple[Request, SeqChunk]]:
        return self._last_batch

    def stats(self) -> EngineStats:
        s, programs = self.scheduler, self.runner.steps
        return EngineStats(len(s.waiting), len(s.running), s.pool.num_pages, s.pool.num_free,
                           self.num_steps, s.num_preemptions, s.prefix_query_tokens,
                           s.prefix_hit_tokens, self.num_computed_tokens,
                           self.num_generated_tokens, programs.num_compiled,
                           programs.num_loaded, programs.num_on_demand)

    def validate(self, prompt_ids: list[int], params: SamplingParams):
        """Reads only the configuration, so any thread may call it."""
        if params.stop and self.tokenizer is None:
            raise JaxinferError("stop strings need a tokenizer; this model has none")
        if not prompt_ids:
            raise JaxinferError("prompt is empty")
        vocab = self.runner.config.vocab_size
        if bad := [t for t in prompt_ids if not 0 <= t < vocab]:
            raise JaxinferError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise JaxinferError(f"prompt has {len(prompt_ids)} tokens; the model's context "
                                f"(max_model_len) is {self.max_model_len}")
        if (need := self.scheduler.pages_needed(len(prompt_ids), params)) > self.runner.num_pages:
            raise JaxinferError(f"the KV cache is too small for this request ({need} pages of "
                                f"{self.runner.page_size} tokens needed, "
                                f"{self.runner.num_pages} in all)")

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        self.validate(prompt_ids, params)
        rid = next(self.request_ids)
        seed = params.seed if params.seed is not None else rid
        req = Request(rid, list(prompt_ids), params, seed=seed % 2**31)  # int32 on device
        output.start(req, self.tokenizer)
        self.scheduler.add(req)
        return req

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestDelta]:
        return self.finish(self.begin())

    def begin(self) -> Launched | None:
        """The first half of `step`: dispatches this step's batch (already dispatched where
        the previous step planned it ahead) and, with `overlap`, plans and dispatches the next
        one behind it; returns this step's batch for `finish`."""
        current, self._ahead = self._ahead, None
        if current is None:
            current = self.launch()
        if current is not None and self.overlap:
            self._ahead = self._launch_ahead(current)
        return current

    def launch(self) -> Launched | None:
        """Schedules a batch and dispatches it to the device without waiting (None: nothing
        to run); `finish` collects it."""
        return self._dispatch(self.scheduler.schedule())

    def _dispatch(self, batch: list[tuple[Request, SeqChunk]]) -> Launched | None:
        if not batch:
            return None
        num_steps = self.scheduler.num_decode_steps(batch)
        with_logprobs = any(req.params.logprobs is not None for req, _ in batch)
        return batch, self.runner.launch([chunk for _, chunk in batch], num_steps,
                                         with_logprobs)

    def _launch_ahead(self, current: Launched) -> Launched | None:
        """Plans and dispatches the batch after `current` while it runs (`overlap`): the
        requests' state moved past current's chunks, each token it samples pending
        (`PENDING_TOKEN`, taken on the device by the next batch's decodes). None where the
        next batch cannot be planned ahead (penalties), or is empty."""
        s = self.scheduler
        if s.num_penalized:
            return None
        rows, last = {}, set()
        for row, (req, chunk) in enumerate(current[0]):
            if req.finished:  # aborted since
                continue
            done = chunk.num_cached + len(chunk.new_tokens)
            s.cache(req, done)
            if done == len(req.all_ids):  # samples a token
                req.all_ids.append(PENDING_TOKEN)
                rows[req] = row
                if s.remaining(req) <= 0:
                    last.add(req)
        batch = s.schedule(ahead=True, last=frozenset(last))
        for req, chunk in batch:
            if req in rows and chunk.num_cached == len(req.all_ids) - 1:
                chunk.prev_row = rows[req]
        return self._dispatch(batch)

    def finish(self, launched: Launched | None) -> list[RequestDelta]:
        """Waits for a launched batch and applies its tokens to the requests."""
        if launched is None:
            return []
        batch, pending = launched
        self._last_batch = batch
        out = self.runner.collect(pending)
        self.num_steps += 1
        scheduler, deltas, eos = self.scheduler, [], self.eos_token_ids
        sampled = out.tokens.tolist()  # at once: a numpy row's tolist per request costs more
        no_logprobs = out.logprobs is None
        computed = generated = 0
        # (this loop runs for every sequence of every step while the next step is planned
        # ahead: counters summed in locals)
        for s, (req, chunk) in enumerate(batch):
            if req.finished:  # ended (or aborted) while this batch ran: its row is dropped
                continue
            ids = req.all_ids
            if ids[-1] == PENDING_TOKEN:  # this batch's token, planned ahead on
                ids.pop()
            first = len(chunk.new_tokens)
            computed += first
            if chunk.num_cached + first < len(ids):  # a prefill chunk, prompt not done
                scheduler.cache(req, chunk.num_cached + first)
                continue
            room = scheduler.remaining(req)
            if no_logprobs:
                tokens, logprobs = output.append_tokens(req, sampled[s], None, None, None,
                                                        room, eos)
            else:
                tokens, logprobs = output.append_tokens(
                    req, sampled[s], out.logprobs[s], out.top_ids[s], out.top_logprobs[s],
                    room, eos)
            computed += len(tokens) - 1
            generated += len(tokens)
            # Step j wrote the k/v of the token before its own: the last token's is not in.
            scheduler.cache(req, chunk.num_cached + first + len(tokens) - 1)
            deltas.append(RequestDelta(req, tokens, output.take_text(req), logprobs,
                                       req.finished))
        self.num_computed_tokens += computed
        self.num_generated_tokens += generated
        scheduler.release_finished()
        return deltas

    def abort(self, req: Request):
        self.scheduler.abort(req)
        if req.all_ids[-1] == PENDING_TOKEN:  # sampled by a batch still running
            req.all_ids.pop()
        req.finish_reason = req.finish_reason or "abort"

    def logits(self, prompts: list[list[int]]) -> list[np.ndarray]:
        """Runs the prompts in programs of at most `logits_rows` tokens (a longer prompt in
        chunks over its pages, one after another), on pages borrowed from the pool. Why:
        a program's float32 logits [T, vocab] outgrow what the planned KV cache leaves a
        step (on an H100 the 8B in batch-invariant mode asked for 10.4 GiB for 2,800
        tokens at once)."""
        for ids in prompts:
            if len(ids) > self.max_model_len:
                raise JaxinferError(f"prompt has {len(ids)} tokens; max_model_len is "
                                    f"{self.max_model_len}")
        rows = self.logits_rows
        out: list[np.ndarray] = []
        group: list[list[int]] = []  # prompts that share a program
        for ids in prompts:
            if group and (sum(map(len, group)) + len(ids) > rows
                          or len(group) == self.max_num_seqs):
                out += self._logits_chunked(group, rows)
                group = []
            group.append(ids)
        if group:
            out += self._logits_chunked(group, rows)
        return out

    @property
    def logits_rows(self) -> int:
        """Tokens a `logits` program runs at most: as many as a sampling step has logits
        rows (max_num_seqs; at least 256, so short prompts are not split), within the step's
        token budget."""
        return min(self.max_num_batched_tokens, max(self.max_num_seqs, 256))

    def _logits_chunked(self, prompts: list[list[int]], rows: int) -> list[np.ndarray]:
        """Logits of prompts that together fit `rows` tokens (one program), or of one longer
        prompt (a program per chunk of `rows` tokens, each attending to the pages before)."""
        pool, page_size = self.scheduler.pool, self.runner.page_size
        held = []
        try:
            for ids in prompts:
                need = -(-len(ids) // page_size)
                pages = pool.allocate(need)
                if pages is None:
                    raise JaxinferError(f"the KV cache is too small for a prompt of {len(ids)} "
                                        f"tokens ({need} pages of {page_size} needed, "
                                        f"{pool.num_free} free)")
                held.append(pages)
            if len(prompts) > 1 or len(prompts[0]) <= rows:
                return self.runner.logits([SeqChunk(new_tokens=list(ids), num_cached=0,
                                                    pages=pages)
                                           for ids, pages in zip(prompts, held, strict=True)])
            ids, pages = prompts[0], held[0]
            return [np.concatenate([
                self.runner.logits([SeqChunk(new_tokens=list(ids[start:start + rows]),
                                             num_cached=start, pages=pages)])[0]
                for start in range(0, len(ids), rows)])]
        finally:
            for pages in held:
                pool.release(pages)


class ReplicatedEngine(EngineInterface):
    """Data parallelism: independent engines (each with its runner on its own sub-mesh) behind
    the one-engine interface. A new request goes to the engine with the fewest requests; a
    step launches every engine's batch before collecting any, so the replicas' devices run
    at the same time. `logits` runs on the first replica."""

    def __init__(self, engines: list[Engine]):
        self.engines = engines
        ids = itertools.count()  # one id sequence: ids (and default seeds) stay unique
        for e in engines:
            e.request_ids = ids
        first = engines[0]
        self.max_model_len, self.max_num_seqs = first.max_model_len, first.max_num_seqs
        self.max_num_batched_tokens = first.max_num_batched_tokens
        self.decode_steps = first.decode_steps
        self._owner: dict[int, Engine] = {}

    @property
    def runners(self) -> list[ModelRunner]:
        return [e.runner for e in self.engines]

    @property
    def waiting(self) -> list[Request]:
        return [r for e in self.engines for r in e.waiting]

    @property
    def running(self) -> list[Request]:
        return [r for e in self.engines for r in e.running]

    @property
    def last_batch(self) -> list[tuple[Request, SeqChunk]]:
        return [item for e in self.engines for item in e.last_batch]

    def stats(self) -> EngineStats:
        return sum((e.stats() for e in self.engines), EngineStats())

    def validate(self, prompt_ids: list[int], params: SamplingParams):
        self.engines[0].validate(prompt_ids, params)

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        engine = min(self.engines, key=lambda e: len(e.waiting) + len(e.running))
        req = engine.add_request(prompt_ids, params)
        self._owner[req.id] = engine
        return req

    def abort(self, req: Request):
        engine = self._owner.pop(req.id, None)
        if engine is not None:
            engine.abort(req)

    def has_unfinished(self) -> bool:
        return any(e.has_unfinished() for e in self.engines)

    def step(self) -> list[RequestDelta]:
        launched = [(e, e.begin()) for e in self.engines]
        deltas = [d for e, work in launched for d in e.finish(work)]
        for d in deltas:
            if d.finished:
                self._owner.pop(d.request.id, None)
        return deltas

    def logits(self, prompts: list[list[int]]) -> list[np.ndarray]:
        return self.engines[0].logits(prompts)
