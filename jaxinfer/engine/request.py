"""What a request is, on the host (no JAX): the caller's `SamplingParams`, the `Request`'s
state while the engine runs it, and what it hands back (`RequestDelta`, `TokenLogprob`)."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from jaxinfer.errors import JaxinferError

if TYPE_CHECKING:
    from jaxinfer.loading.tokenizer import IncrementalDecoder

MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs


@dataclasses.dataclass
class SamplingParams:
    """Like vLLM's: temperature 0 is greedy; top_k 0 (or -1), top_p 1 and min_p 0 disable
    those filters; penalties of 1.0 (repetition) and 0.0 (presence, frequency) are off.

    stop: strings that end the output (not included in the text); logprobs: None, or the
    number of top alternatives to return per token (0 = only the sampled token's).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (self.temperature >= 0, "temperature", "must be >= 0"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (-1 <= self.top_k < 2**31, "top_k", "must be -1, 0 or positive (int32)"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (self.max_tokens >= 1, "max_tokens", "must be >= 1"),
            (self.repetition_penalty > 0, "repetition_penalty", "must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
             f"must be between 0 and {MAX_LOGPROBS}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop",
             "must be non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "must be non-negative token ids"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise JaxinferError(f"{name}={getattr(self, name)!r}: {why}")

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


@dataclasses.dataclass
class TokenLogprob:
    """A generated token's logprob and the top alternatives [(token_id, logprob)], best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclasses.dataclass(eq=False)  # identity, not field equality
class Request:
    """One request through the engine. The scheduler reads and moves its tokens and pages
    (all_ids, num_cached, pages, hashes); the output side (`jaxinfer.engine.output`) fills
    in its text, logprobs and finish reason."""

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
