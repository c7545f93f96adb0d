"""The output side of a request, on the host (no JAX): sampled tokens appended, stop ids,
EOS and the length limit, logprobs, incremental detokenisation and stop strings.

Output text is detokenised incrementally per request (`IncrementalDecoder`: a
multi-byte character is never split); stop strings are matched on that text and
held back while they could still be the start of one. After a multi-step decode the
host applies the stop strings and stop ids here and drops what follows a stop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxinfer.engine.request import Request, TokenLogprob
from jaxinfer.loading.tokenizer import IncrementalDecoder, Tokenizer

if TYPE_CHECKING:
    import numpy as np


def start(req: Request, tokenizer: Tokenizer | None):
    """Readies a new request's output: its logprob list when asked for, and its detokeniser."""
    if req.params.logprobs is not None:
        req.logprobs = []
    if tokenizer is not None:
        req.detokenizer = IncrementalDecoder(tokenizer, req.prompt_ids,
                                             req.params.skip_special_tokens)


def append_tokens(req: Request, tokens: list[int], logprobs: np.ndarray | None,
                  top_ids: np.ndarray | None, top_logprobs: np.ndarray | None, room: int,
                  eos_token_ids: set[int]) -> tuple[list[int], list[TokenLogprob] | None]:
    """Appends one step's sampled tokens to req, up to the first that finishes it.

    tokens: req's row of the step's output (-1 after it finished on the device);
    logprobs [N] f32, top_ids / top_logprobs [N, MAX_LOGPROBS] (its rows of `StepOutput`,
    read only when req asked for logprobs); room: the tokens req could still produce
    before this step. Returns the tokens kept and their TokenLogprobs (None if not asked
    for), which are also added to req.logprobs.
    """
    kept, kept_logprobs = [], [] if req.params.logprobs is not None else None
    # This loop runs for every token of every sequence while the GPU waits (64 x 32
    # per call in the throughput benchmark), so it keeps to a few lookups per token.
    for j, token in enumerate(tokens):
        if token < 0:
            break
        req.all_ids.append(token)
        kept.append(token)
        if kept_logprobs is not None:
            top = req.params.logprobs
            kept_logprobs.append(TokenLogprob(token, float(logprobs[j]), list(zip(
                top_ids[j, :top].tolist(), top_logprobs[j, :top].tolist(), strict=True))))
        _check_stop(req, token, room - j - 1, eos_token_ids)
        if req.detokenizer is not None:
            _push_text(req, token)
        if req.finish_reason is not None:
            break
    if kept_logprobs is not None:
        req.logprobs.extend(kept_logprobs)
    return kept, kept_logprobs


def take_text(req: Request) -> str:
    """The text not yet handed out, less a tail that could still start a stop string."""
    hold = 0
    if req.params.stop and not req.finished:
        hold = max(map(len, req.params.stop)) - 1
    end = max(req.num_emitted_chars, len(req.text) - hold)
    delta = req.text[req.num_emitted_chars:end]
    req.num_emitted_chars = end
    return delta


def _check_stop(req: Request, token: int, remaining: int, eos_token_ids: set[int]):
    """Finishes req if `token` (just appended) is a stop id or EOS, or if it may produce
    no more (`remaining`: what it may still produce, with token counted)."""
    p = req.params
    if token in p.stop_token_ids:
        req.finish_reason, req.stop_reason = "stop", token
    elif token in eos_token_ids and not p.ignore_eos:
        req.finish_reason = "stop"
    elif remaining <= 0:
        req.finish_reason = "length"


def _push_text(req: Request, token: int):
    """Detokenises a kept token (a stop token is not text) and applies the stop strings:
    the text is cut where one starts, and the request finishes."""
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
