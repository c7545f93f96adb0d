"""The engine: requests, a page allocator, and a continuous-batching scheduler.

Each `step()` builds one ragged batch: every running request that has caught
up with its tokens decodes one token, and requests still prefilling add a
chunk of their prompt, all under a per-step token budget. A request gets all
the pages it can ever need (prompt + max_tokens) when it is admitted, so a
running request never runs out of pages.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque

from jaxinfer.errors import JaxinferError
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


class PageAllocator:
    """A free list of KV pages."""

    def __init__(self, num_pages: int):
        self.free = deque(range(num_pages))

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        return [self.free.popleft() for _ in range(n)]

    def release(self, pages: list[int]):
        self.free.extend(pages)


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
        self.allocator = PageAllocator(runner.num_pages)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._ids = itertools.count()
        self.num_steps = 0  # batches run (benchmarks divide time by it)

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        if not prompt_ids:
            raise JaxinferError("prompt is empty")
        vocab = self.runner.config.vocab_size
        if bad := [t for t in prompt_ids if not 0 <= t < vocab]:
            raise JaxinferError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise JaxinferError(f"prompt has {len(prompt_ids)} tokens; the model's context "
                                f"(max_model_len) is {self.max_model_len}")
        rid = next(self._ids)
        seed = params.seed if params.seed is not None else rid
        req = Request(rid, list(prompt_ids), params, seed=seed % 2**31)  # int32 on device
        self.waiting.append(req)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _pages_needed(self, req: Request) -> int:
        total = min(len(req.prompt_ids) + req.params.max_tokens, self.max_model_len)
        return -(-total // self.runner.page_size)

    def _admit(self):
        while self.waiting and len(self.running) < self.max_num_seqs:
            pages = self.allocator.allocate(self._pages_needed(self.waiting[0]))
            if pages is None:
                if not self.running:
                    raise JaxinferError("the KV cache is too small for one request "
                                        f"({self._pages_needed(self.waiting[0])} pages needed, "
                                        f"{self.runner.num_pages} in all)")
                return
            req = self.waiting.popleft()
            req.pages = pages
            self.running.append(req)

    def schedule(self) -> list[tuple[Request, SeqChunk]]:
        """Decodes first (one token each), then prefill chunks, within the token budget."""
        self._admit()
        budget = self.max_num_batched_tokens
        batch = []
        decoding = [r for r in self.running if r.num_cached == len(r.all_ids) - 1]
        prefilling = [r for r in self.running if r.num_cached < len(r.all_ids) - 1]
        for req in decoding + prefilling:
            n = min(len(req.all_ids) - req.num_cached, budget)
            if n <= 0:
                break
            budget -= n
            p = req.params
            batch.append((req, SeqChunk(
                new_tokens=req.all_ids[req.num_cached:req.num_cached + n],
                num_cached=req.num_cached, pages=req.pages, temperature=p.temperature,
                top_k=max(p.top_k, 0), top_p=p.top_p, seed=req.seed,
                step=req.num_output)))
        return batch

    def step(self) -> list[tuple[Request, list[int]]]:
        """Runs one batch; returns (request, tokens it gained) for the requests that gained any."""
        batch = self.schedule()
        if not batch:
            return []
        sampled = self.runner.step([chunk for _, chunk in batch])
        self.num_steps += 1
        updates = []
        for (req, chunk), token in zip(batch, sampled, strict=True):
            req.num_cached += len(chunk.new_tokens)
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
