"""The engine: requests, the KV page pool, and a continuous-batching scheduler.

Each `step()` builds one ragged batch: every running request that has caught
up with its tokens decodes one token, and requests still prefilling add a
chunk of their prompt, all under a per-step token budget.

Pages (`jaxinfer.kv_pages.PagePool`) are taken as the tokens need them. A new
request first reuses the cached full pages of its longest cached prefix (prefix
caching: those tokens are not prefilled again) and is admitted only when the
rest of its prompt fits in the free pages. When a request needs a page and none
is free, the newest running requests not yet in this step's batch are
preempted: their pages are released (they stay cached) and they go back to the
front of the queue, to be recomputed later with the tokens they already
generated (sampling keys depend on the token count only, so the output is the
same). The oldest request is never preempted for a newer one, so none starves.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque

from jaxinfer.errors import JaxinferError
from jaxinfer.kv_pages import PagePool, page_hashes
from jaxinfer.runner import ModelRunner, SeqChunk
from jaxinfer.sampling import SamplingParams


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


class Engine:
    def __init__(self, runner: ModelRunner, eos_token_ids, max_model_len: int,
                 max_num_seqs: int = 8, max_num_batched_tokens: int = 512):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise JaxinferError(f"max_num_seqs={max_num_seqs} and max_num_batched_tokens="
                                f"{max_num_batched_tokens} must both be >= 1")
        self.runner = runner
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

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Request:
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
        rid = next(self._ids)
        seed = params.seed if params.seed is not None else rid
        req = Request(rid, list(prompt_ids), params, seed=seed % 2**31)  # int32 on device
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
            p = req.params
            batch.append((req, SeqChunk(
                new_tokens=req.all_ids[req.num_cached:req.num_cached + n],
                num_cached=req.num_cached, pages=req.pages, temperature=p.temperature,
                top_k=max(p.top_k, 0), top_p=p.top_p, seed=req.seed,
                step=req.num_output)))
        if not batch and self.running:  # cannot happen: the oldest request always fits
            raise JaxinferError("scheduler stalled: no running request could get KV pages")
        return batch

    def step(self) -> list[tuple[Request, list[int]]]:
        """Runs one batch; returns (request, tokens it gained) for the requests that gained any."""
        batch = self.schedule()
        if not batch:
            return []
        sampled = self.runner.step([chunk for _, chunk in batch])
        self.num_steps += 1
        updates = []
        ps = self.runner.page_size
        for (req, chunk), token in zip(batch, sampled, strict=True):
            req.num_cached += len(chunk.new_tokens)
            self.num_computed_tokens += len(chunk.new_tokens)
            # Cache the pages this chunk filled, under the hash of the prefix they end.
            hashes = page_hashes(req.all_ids, ps, req.hashes)
            for i in range(chunk.num_cached // ps, req.num_cached // ps):
                self.allocator.register(req.pages[i], hashes[i])
            if req.num_cached < len(req.all_ids):
                continue  # a prefill chunk that has not reached the prompt's end
            req.all_ids.append(int(token))
            self._check_stop(req)
            updates.append((req, [int(token)]))
        for req in [r for r in self.running if r.finished]:
            self.running.remove(req)
            self.allocator.release(req.pages)
            req.pages = []
        return updates

    def _check_stop(self, req: Request):
        token, p = req.all_ids[-1], req.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            req.finish_reason = "stop"
        elif req.num_output >= p.max_tokens or len(req.all_ids) >= self.max_model_len:
            req.finish_reason = "length"

    def abort(self, req: Request):
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
            self.allocator.release(req.pages)
            req.pages = []
        req.finish_reason = req.finish_reason or "abort"
