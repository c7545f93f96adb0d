"""The continuous-batching scheduler, on the host (no JAX): admission, KV page reservation,
preemption, prefill chunking and the choice of a multi-step decode.

Each `schedule()` builds one ragged batch: every running request that has caught
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

With `decode_steps` N > 1, a batch that is all decodes (nothing waiting or
prefilling) runs up to N decode steps on the device in one call (`num_decode_steps`).

`schedule(ahead=True)` plans a step while the one before it still runs (the engine's
overlap): each request that samples in the running step holds PENDING_TOKEN as its last
id until the step's tokens are read back (nothing hashes it or sends it anywhere); the
requests for which that token is the last allowed are not planned again, and nothing is
preempted.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import deque

from jaxinfer.engine.kv_pages import PagePool, page_hashes
from jaxinfer.engine.request import Request, SamplingParams
from jaxinfer.errors import JaxinferError

# The id of a token sampled by a step still on the device (`Scheduler.schedule`'s ahead):
# never a real token id, which are >= 0.
PENDING_TOKEN = -1


@dataclasses.dataclass(slots=True)  # (built for every sequence every step)
class SeqChunk:
    """One sequence's share of a step: tokens[num_cached : num_cached + len(new_tokens)].

    history (prompt + output ids so far) is needed only for penalties; remaining
    bounds a multi-step decode (at most that many tokens are kept).
    """

    new_tokens: list[int]
    num_cached: int  # tokens already in this sequence's pages
    pages: list[int]
    params: SamplingParams | None = None  # None: greedy
    seed: int = 0
    step: int = 0  # tokens generated so far
    history: list[int] | None = None
    num_prompt: int = 0
    remaining: int = 1
    # >= 0: new_tokens[0] is the token the previous step sampled in this row, not yet read
    # back (its place in the request's ids holds PENDING_TOKEN): see `Engine`'s overlap.
    prev_row: int = -1


class Scheduler:
    """The waiting queue, the running requests and their pages; decides what each step runs.

    Counts what it did: num_preemptions, and the prompt tokens looked up in the prefix cache
    at admission (prefix_query_tokens) and found there (prefix_hit_tokens).
    """

    def __init__(self, num_pages: int, page_size: int, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, decode_steps: int):
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.decode_steps = decode_steps
        self.pool = PagePool(num_pages, page_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_query_tokens = self.prefix_hit_tokens = 0
        # Requests waiting or running with penalties (which need their whole history each
        # step): counted as they come and go, not looked for every step.
        self.num_penalized = 0

    def pages_needed(self, prompt_len: int, params: SamplingParams) -> int:
        """Pages for the longest the request can grow (prompt + max_tokens, capped)."""
        total = min(prompt_len + params.max_tokens, self.max_model_len)
        return -(-total // self.page_size)

    def add(self, req: Request):
        self.waiting.append(req)
        self.num_penalized += req.params.has_penalties

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remaining(self, req: Request) -> int:
        """Tokens req may still produce (max_tokens, and the context)."""
        return min(req.params.max_tokens - req.num_output,
                   self.max_model_len - len(req.all_ids))

    def schedule(self, ahead: bool = False, last: frozenset[Request] = frozenset()
                 ) -> list[tuple[Request, SeqChunk]]:
        """Decodes first (oldest first, one token each), then prefill chunks, in the budget.

        ahead: planned while the previous step runs, whose sampled tokens are the pending
        last ids of their requests (their decodes take them from the device); `last`: the
        requests whose pending token is their last (the length limit), not run again.
        Nothing else is known of that step: a request it ends by EOS or a stop runs one
        token more, which the engine drops. A request that needs a page none has free waits
        for the next step instead of preempting one (a preempted request would be
        recomputed without the token it is sampling)."""
        self._admit()
        budget = self.max_num_batched_tokens
        batch, scheduled = [], set()
        decoding = [r for r in self.running if r.num_cached == len(r.all_ids) - 1]
        prefilling = [r for r in self.running if r.num_cached < len(r.all_ids) - 1]
        # The running requests as a set, rebuilt after a preemption in this loop (a list
        # scan per request is quadratic in them).
        preemptions, running = self.num_preemptions, set(self.running)
        by_id = operator.attrgetter("id")
        for req in sorted(decoding, key=by_id) + sorted(prefilling, key=by_id):
            if self.num_preemptions != preemptions:
                preemptions, running = self.num_preemptions, set(self.running)
            if req not in running or req in last:
                continue  # preempted for an older request in this loop, or finishing
            n = min(len(req.all_ids) - req.num_cached, budget)
            if n <= 0:
                break
            if not self._reserve(req, req.num_cached + n, scheduled, preempt=not ahead):
                continue
            budget -= n
            scheduled.add(req)
            batch.append((req, self._chunk(req, n)))
        if not batch and self.running and not ahead:  # the oldest request always fits
            raise JaxinferError("scheduler stalled: no running request could get KV pages")
        return batch

    def num_decode_steps(self, batch: list[tuple[Request, SeqChunk]]) -> int:
        """N > 1 for a batch of every running request, all decoding, with nothing waiting,
        when each can get the pages for its next min(N, remaining) tokens (then reserved,
        and the chunks' page lists updated)."""
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

    def cache(self, req: Request, num_cached: int):
        """Records that req's first num_cached tokens are in its pages, and registers the
        pages that became full in the prefix cache, under the hash of the prefix they end."""
        ps = self.page_size
        if num_cached // ps > req.num_cached // ps:  # (most decode steps fill no page)
            hashes = page_hashes(req.all_ids, ps, req.hashes)
            for i in range(req.num_cached // ps, num_cached // ps):
                self.pool.register(req.pages[i], hashes[i])
        req.num_cached = num_cached

    def release_finished(self):
        """Drops the finished requests from the running ones and frees their pages."""
        for req in [r for r in self.running if r.finished]:
            self.running.remove(req)
            self.pool.release(req.pages)
            req.pages = []
            self.num_penalized -= req.params.has_penalties

    def abort(self, req: Request):
        """Drops req from the queue or the running requests (its pages freed)."""
        if req in self.waiting:
            self.waiting.remove(req)
            self.num_penalized -= req.params.has_penalties
        if req in self.running:
            self.running.remove(req)
            self.pool.release(req.pages)
            req.pages = []
            self.num_penalized -= req.params.has_penalties

    def _admit(self):
        """Moves waiting requests to running while their uncached prompt fits the free pages."""
        pool, ps = self.pool, self.page_size
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
        self.pool.release(req.pages)
        req.pages, req.num_cached = [], 0
        # Newest first, so the queue's front keeps arrival order.
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _reserve(self, req: Request, num_tokens: int, scheduled: set,
                 preempt: bool = True) -> bool:
        """Gives req pages for num_tokens tokens, preempting newer unscheduled requests if
        needed (and allowed); False if it must wait."""
        need = -(-num_tokens // self.page_size) - len(req.pages)
        if need <= 0:  # (most decodes: their last page has room)
            return True
        while need > self.pool.num_free:
            newer = [r for r in self.running if r.id > req.id and r not in scheduled]
            if not newer or not preempt:
                return False
            self._preempt(max(newer, key=lambda r: r.id))
        req.pages = req.pages + self.pool.allocate(need)
        return True

    def _chunk(self, req: Request, n: int) -> SeqChunk:
        p, ids, cached = req.params, req.all_ids, req.num_cached
        return SeqChunk(ids[cached:cached + n], cached, req.pages, p, req.seed, req.num_output,
                        ids if p.has_penalties else None, len(req.prompt_ids),
                        self.remaining(req))
