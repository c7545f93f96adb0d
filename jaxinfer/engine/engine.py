"""The engine: requests, the KV page pool, and a continuous-batching scheduler.

Each `step()` builds one ragged batch: every running request that has caught
up with its tokens decodes one token, and requests still prefilling add a
chunk of their prompt, all under a per-step token budget.

Pages (`jaxinfer.engine.kv_pages.PagePool`) are taken as the tokens need them. A new
request first reuses the cached full pages of its longest cached prefix (prefix
caching: those tokens are not prefilled again) and is admitted only when the
rest of its prompt fits in the free pages. When a request needs a page and none
is free, the newest running requests not yet in this step's batch are
preempted: their pages are released (they stay cached) and they go back to the
front of the queue, to be recomputed later with the tokens they already
generated (sampling keys depend on the token count only, so the output is the
same). The oldest request is never preempted for a newer one, so none starves.

With `decode_steps` N > 1, a step whose batch is all decodes (nothing waiting or
prefilling) runs up to N decode steps on the device in one call, exiting early
once every sequence has hit EOS or its token budget; the host then applies the
stop strings and stop ids and drops what follows a stop.

Output text is detokenised incrementally per request (`IncrementalDecoder`: a
multi-byte character is never split); stop strings are matched on that text and
held back while they could still be the start of one.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque

from jaxinfer.engine.kv_pages import PagePool, page_hashes
from jaxinfer.engine.runner import ModelRunner, SeqChunk
from jaxinfer.engine.sampling import SamplingParams, TokenLogprob
from jaxinfer.errors import JaxinferError
from jaxinfer.loading.tokenizer import IncrementalDecoder, Tokenizer


@dataclasses.dataclass(eq=False)  # identity, not field equality
class Request:
    id: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    all_ids: list[int] = dataclasses.field(init=False)  # prompt, then outputs
    num_cached: int = 0  # tokens whose k/v are in the pages
    pages: list[int] = dataclasses.field(default_factory=list)
    # Hashes of the full pages of all_ids so far (content only, so they survive preemption).
    hashes: list[bytes] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    text: str = ""  # visible output text so far (stop strings cut off)
    num_emitted_chars: int = 0  # of text, handed out in deltas
    logprobs: list[TokenLogprob] | None = None  # one per output token, when asked for
    num_prefix_hit: int | None = None  # prompt tokens found in the prefix cache (first admission)
    detokenizer: IncrementalDecoder | None = None
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)

    def __post_init__(self):
        self.all_ids = list(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.all_ids[len(self.prompt_ids):]

    @property
    def num_output(self) -> int:
        return len(self.all_ids) - len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestDelta:
    """What one step added to a request: tokens (several after a multi-step decode), the new
    visible text, one TokenLogprob per token when asked for, and whether it finished."""

    request: Request
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finished: bool


class Engine:
    def __init__(self, runner: ModelRunner, eos_token_ids, max_model_len: int,
                 max_num_seqs: int = 8, max_num_batched_tokens: int = 512,
                 tokenizer: Tokenizer | None = None, decode_steps: int = 1):
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
        self.allocator = PagePool(runner.num_pages, runner.page_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._ids = itertools.count()
        self.num_steps = 0  # batches run (benchmarks divide time by it)
        self.num_preemptions = 0
        # Prompt tokens looked up in the prefix cache at admission, and found there.
        self.prefix_query_tokens = self.prefix_hit_tokens = 0
        self.num_computed_tokens = 0  # tokens run through the model (prefill + decode)
        self.num_generated_tokens = 0  # output tokens kept
        self.last_batch: list[tuple[Request, SeqChunk]] = []  # what the last step ran

    def validate(self, prompt_ids: list[int], params: SamplingParams):
        """Raises JaxinferError (one line) for a request the engine cannot take. Reads only
        the configuration, so any thread may call it."""
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
        if (need := self._pages_needed(len(prompt_ids), params)) > self.runner.num_pages:
            raise JaxinferError(f"the KV cache is too small for this request ({need} pages of "
                                f"{self.runner.page_size} tokens needed, "
                                f"{self.runner.num_pages} in all)")

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        self.validate(prompt_ids, params)
        rid = next(self._ids)
        seed = params.seed if params.seed is not None else rid
        req = Request(rid, list(prompt_ids), params, seed=seed % 2**31)  # int32 on device
        if params.logprobs is not None:
            req.logprobs = []
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDecoder(self.tokenizer, req.prompt_ids,
                                                 params.skip_special_tokens)
        self.waiting.append(req)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _pages_needed(self, prompt_len: int, params: SamplingParams) -> int:
        """Pages for the longest the request can grow (prompt + max_tokens, capped)."""
        total = min(prompt_len + params.max_tokens, self.max_model_len)
        return -(-total // self.runner.page_size)

    def _admit(self):
        """Moves waiting requests to running while their uncached prompt fits the free pages."""
        pool, ps = self.allocator, self.runner.page_size
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            # Only full pages before the last token: its logits must be computed.
            hashes = page_hashes(req.all_ids, ps, req.hashes)
            pages = pool.lookup(hashes[:(len(req.all_ids) - 1) // ps])
            need = -(-len(req.all_ids) // ps) - len(pages)
            if need > pool.num_free - sum(pool.ref[p] == 0 for p in pages):
                return
            self.waiting.popleft()
            pool.take(pages)
            req.pages = pages
            req.num_cached = len(pages) * ps
            self.prefix_query_tokens += len(req.all_ids)
            self.prefix_hit_tokens += req.num_cached
            if req.num_prefix_hit is None:
                req.num_prefix_hit = req.num_cached
            self.running.append(req)

    def _preempt(self, req: Request):
        self.running.remove(req)
        self.allocator.release(req.pages)
        req.pages, req.num_cached = [], 0
        # Newest first, so the queue's front keeps arrival order.
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _reserve(self, req: Request, num_tokens: int, scheduled: set) -> bool:
        """Gives req pages for num_tokens tokens, preempting newer unscheduled requests if
        needed; False if it must wait (nothing newer to preempt)."""
        need = -(-num_tokens // self.runner.page_size) - len(req.pages)
        while need > self.allocator.num_free:
            newer = [r for r in self.running if r.id > req.id and r not in scheduled]
            if not newer:
                return False
            self._preempt(max(newer, key=lambda r: r.id))
        if need > 0:
            req.pages = req.pages + self.allocator.allocate(need)
        return True

    def schedule(self) -> list[tuple[Request, SeqChunk]]:
        """Decodes first (oldest first, one token each), then prefill chunks, in the budget."""
        self._admit()
        budget = self.max_num_batched_tokens
        batch, scheduled = [], set()
        decoding = [r for r in self.running if r.num_cached == len(r.all_ids) - 1]
        prefilling = [r for r in self.running if r.num_cached < len(r.all_ids) - 1]
        for req in sorted(decoding, key=lambda r: r.id) + sorted(prefilling, key=lambda r: r.id):
            if req not in self.running:
                continue  # preempted for an older request in this loop
            n = min(len(req.all_ids) - req.num_cached, budget)
            if n <= 0:
                break
            if not self._reserve(req, req.num_cached + n, scheduled):
                continue
            budget -= n
            scheduled.add(req)
            batch.append((req, self._chunk(req, n)))
        if not batch and self.running:  # cannot happen: the oldest request always fits
            raise JaxinferError("scheduler stalled: no running request could get KV pages")
        return batch

    def _remaining(self, req: Request) -> int:
        """Tokens req may still produce (max_tokens, and the context)."""
        return min(req.params.max_tokens - req.num_output,
                   self.max_model_len - len(req.all_ids))

    def _chunk(self, req: Request, n: int) -> SeqChunk:
        p = req.params
        return SeqChunk(new_tokens=req.all_ids[req.num_cached:req.num_cached + n],
                        num_cached=req.num_cached, pages=req.pages, params=p, seed=req.seed,
                        step=req.num_output, history=req.all_ids if p.has_penalties else None,
                        num_prompt=len(req.prompt_ids), remaining=self._remaining(req))

    def _decode_steps(self, batch) -> int:
        """N > 1 for a batch of every running request, all decoding, with nothing waiting,
        when each can get the pages for its next min(N, remaining) tokens."""
        n = self.decode_steps
        if (n == 1 or self.waiting or len(batch) != len(self.running)
                or any(len(c.new_tokens) != 1 for _, c in batch)):
            return 1
        everyone = {req for req, _ in batch}
        for req, chunk in batch:
            if not self._reserve(req, req.num_cached + min(n, chunk.remaining), everyone):
                return 1
            chunk.pages = req.pages
        return n

    def step(self) -> list[RequestDelta]:
        """Runs one batch; returns a delta for each request that gained tokens."""
        return self.finish(self.launch())

    def launch(self):
        """Schedules a batch and dispatches it to the device without waiting (None: nothing
        to run); `finish` collects it."""
        batch = self.last_batch = self.schedule()
        if not batch:
            return None
        num_steps = self._decode_steps(batch)
        with_logprobs = any(req.params.logprobs is not None for req, _ in batch)
        return batch, self.runner.launch([chunk for _, chunk in batch], num_steps,
                                         with_logprobs)

    def finish(self, launched) -> list[RequestDelta]:
        """Waits for a launched batch and applies its tokens to the requests."""
        if launched is None:
            return []
        batch, pending = launched
        out = self.runner.collect(pending)
        self.num_steps += 1
        deltas = []
        for s, (req, chunk) in enumerate(batch):
            first = len(chunk.new_tokens)
            self.num_computed_tokens += first
            if chunk.num_cached + first < len(req.all_ids):  # a prefill chunk, prompt not done
                self._cache(req, chunk.num_cached + first)
                continue
            tokens, logprobs = [], [] if req.params.logprobs is not None else None
            # This loop runs for every token of every sequence while the GPU waits (64 x 32
            # per call in the throughput benchmark), so it keeps to a few lookups per token.
            room = self._remaining(req)  # tokens req may produce, before this step's
            for j, token in enumerate(out.tokens[s].tolist()):
                if token < 0:
                    break
                req.all_ids.append(token)
                tokens.append(token)
                if logprobs is not None:
                    top = req.params.logprobs
                    logprobs.append(TokenLogprob(token, float(out.logprobs[s, j]), list(zip(
                        out.top_ids[s, j, :top].tolist(), out.top_logprobs[s, j, :top].tolist(),
                        strict=True))))
                self._check_stop(req, token, room - j - 1)
                if req.detokenizer is not None:
                    self._push_text(req, token)
                if req.finish_reason is not None:
                    break
            self.num_computed_tokens += len(tokens) - 1
            self.num_generated_tokens += len(tokens)
            # Step j wrote the k/v of the token before its own: the last token's is not in.
            self._cache(req, chunk.num_cached + first + len(tokens) - 1)
            if logprobs is not None:
                req.logprobs.extend(logprobs)
            deltas.append(RequestDelta(req, tokens, self._emit(req), logprobs, req.finished))
        for req in [r for r in self.running if r.finished]:
            self.running.remove(req)
            self.allocator.release(req.pages)
            req.pages = []
        return deltas

    def _cache(self, req: Request, num_cached: int):
        """Records that req's first num_cached tokens are in its pages, and registers the
        pages that became full in the prefix cache, under the hash of the prefix they end."""
        ps = self.runner.page_size
        hashes = page_hashes(req.all_ids, ps, req.hashes)
        for i in range(req.num_cached // ps, num_cached // ps):
            self.allocator.register(req.pages[i], hashes[i])
        req.num_cached = num_cached

    def _push_text(self, req: Request, token: int):
        """Detokenises a kept token (a stop token is not text) and applies the stop strings:
        the text is cut where one starts, and the request finishes."""
        if req.detokenizer is None:
            return
        start = len(req.text)
        if req.finish_reason != "stop":  # EOS or a stop id ended it: no text
            req.text += req.detokenizer.push([token])
        if req.finished:
            req.text += req.detokenizer.flush()
        if req.params.stop:
            window = max(0, start - max(map(len, req.params.stop)) + 1)
            found = [(i, s) for s in req.params.stop if (i := req.text.find(s, window)) >= 0]
            if found:
                i, stop = min(found)
                req.text = req.text[:i]
                req.finish_reason, req.stop_reason = "stop", stop

    def _emit(self, req: Request) -> str:
        """The text not yet handed out, less a tail that could still start a stop string."""
        hold = 0
        if req.params.stop and not req.finished:
            hold = max(map(len, req.params.stop)) - 1
        end = max(req.num_emitted_chars, len(req.text) - hold)
        delta = req.text[req.num_emitted_chars:end]
        req.num_emitted_chars = end
        return delta

    def _check_stop(self, req: Request, token: int, remaining: int):
        """Finishes req if `token` (just appended) is a stop id or EOS, or if it may produce
        no more (`remaining`: `_remaining(req)` with token counted)."""
        p = req.params
        if token in p.stop_token_ids:
            req.finish_reason, req.stop_reason = "stop", token
        elif token in self.eos_token_ids and not p.ignore_eos:
            req.finish_reason = "stop"
        elif remaining <= 0:
            req.finish_reason = "length"

    def abort(self, req: Request):
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
            self.allocator.release(req.pages)
            req.pages = []
        req.finish_reason = req.finish_reason or "abort"


class ReplicatedEngine:
    """Data parallelism: independent engines (each with its runner on its own sub-mesh) behind
    the one-engine interface. A new request goes to the engine with the fewest requests; a
    step launches every engine's batch before collecting any, so the replicas' devices run
    at the same time."""

    def __init__(self, engines: list[Engine]):
        self.engines = engines
        ids = itertools.count()  # one id sequence: ids (and default seeds) stay unique
        for e in engines:
            e._ids = ids
        first = engines[0]
        self.runner, self.tokenizer, self.decode_steps = (first.runner, first.tokenizer,
                                                          first.decode_steps)
        self.eos_token_ids, self.max_model_len = first.eos_token_ids, first.max_model_len
        self.max_num_seqs = first.max_num_seqs
        self.max_num_batched_tokens = first.max_num_batched_tokens
        self._owner: dict[int, Engine] = {}

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
        launched = [(e, e.launch()) for e in self.engines]
        deltas = [d for e, work in launched for d in e.finish(work)]
        for d in deltas:
            if d.finished:
                self._owner.pop(d.request.id, None)
        return deltas

    @property
    def waiting(self) -> list[Request]:
        return [r for e in self.engines for r in e.waiting]

    @property
    def running(self) -> list[Request]:
        return [r for e in self.engines for r in e.running]

    @property
    def last_batch(self) -> list[tuple[Request, SeqChunk]]:
        return [item for e in self.engines for item in e.last_batch]

    @property
    def allocator(self) -> PoolTotals:
        return PoolTotals(sum(e.allocator.num_pages for e in self.engines),
                          sum(e.allocator.num_free for e in self.engines))

    def __getattr__(self, name):
        if name in _COUNTERS:  # summed over the replicas
            return sum(getattr(e, name) for e in self.engines)
        raise AttributeError(name)


_COUNTERS = ("num_steps", "num_preemptions", "prefix_query_tokens", "prefix_hit_tokens",
             "num_computed_tokens", "num_generated_tokens")


@dataclasses.dataclass(frozen=True)
class PoolTotals:
    """The page pools of several engines, summed (what metrics report)."""

    num_pages: int
    num_free: int
