"""The OpenAI API's request bodies (pydantic) and the pieces of its responses.

Request models accept what the OpenAI completions and chat endpoints accept and
map the sampling fields onto `SamplingParams` (plus vLLM's extensions: top_k,
min_p, repetition_penalty, stop_token_ids, ignore_eos, skip_special_tokens,
return_token_ids). Fields that would change the result in ways the engine cannot
do (n > 1, echo, suffix, best_of, logit_bias, tools, JSON response formats) are
rejected with `APIError` rather than silently ignored; other unknown fields are
ignored, as vLLM does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from jaxinfer.engine.request import SamplingParams

INT32_MAX = 2**31 - 1


class APIError(Exception):
    """A request the server answers with `status` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status, message, param, code, type)

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Body(BaseModel):
    # JSON allows NaN/Infinity in Python's parser; no sampling field means anything with them.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingRequest(_Body):
    """The fields completions and chat share."""

    model: str | None = None  # None: the served model
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = Field(0, le=INT32_MAX)
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    return_token_ids: bool = False  # vLLM's extension: prompt and output token ids
    user: str | None = None

    def check_supported(self):
        for name in ("max_tokens", "max_completion_tokens"):
            if (value := getattr(self, name, None)) is not None and value < 1:
                raise APIError(400, f"{name}={value}: must be >= 1", name)
        if self.n != 1:
            raise APIError(400, f"n={self.n}: only n=1 is supported", "n")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true",
                           "stream_options")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises JaxinferError (a 400) for values SamplingParams rejects."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            max_tokens=max_tokens, seed=self.seed, stop=stop,
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens)


class CompletionRequest(_SamplingRequest):
    # A string, token ids, or a one-element list of either (one prompt per request).
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = None  # None: up to the end of the context
    logprobs: int | None = None  # top-n alternatives per token (0: the sampled token only)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self):
        super().check_supported()
        if self.echo:
            raise APIError(400, "echo=true is not supported", "echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise APIError(400, f"best_of={self.best_of}: only 1 is supported", "best_of")

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise APIError(400, f"prompt: a list of {len(p)} prompts; send one prompt per "
                               "request", "prompt")
            return p[0]
        return p


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ResponseFormat(_Body):
    type: str = "text"


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # the newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: ResponseFormat | None = None

    def check_supported(self):
        super().check_supported()
        if self.tools:
            raise APIError(400, "tools are not supported", "tools")
        if self.response_format and self.response_format.type != "text":
            raise APIError(400, f"response_format type {self.response_format.type!r} is not "
                           "supported (only 'text')", "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict]:
        """Messages for the chat template: content parts joined into one string."""
        out = []
        for i, m in enumerate(self.messages):
            content = m.content
            if isinstance(content, list):
                texts = []
                for j, part in enumerate(content):
                    if part.type != "text" or part.text is None:
                        raise APIError(400, f"messages[{i}].content[{j}]: part type "
                                       f"{part.type!r} is not supported (only 'text' parts "
                                       "with a 'text' field)", f"messages[{i}].content")
                    texts.append(part.text)
                content = "\n".join(texts)
            msg = {"role": m.role, "content": content if content is not None else ""}
            if m.name is not None:
                msg["name"] = m.name
            out.append(msg)
        return out


# -- responses -------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class CompletionLogprobs:
    """Accumulates the completions API's `logprobs` object (tokens, token_logprobs,
    top_logprobs, text_offset) over deltas; text_offset counts from the completion's start."""

    def __init__(self, token_text: Callable[[int], str]):
        self.token_text = token_text
        self.offset = 0

    def add(self, entries: Sequence) -> dict:
        """The logprobs object for these TokenLogprob entries (one delta's, or all)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            text = self.token_text(e.token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(e.logprob)
            # Token strings are keys here (the API's format): distinct ids with the same
            # text keep the first (the likeliest, as `top` is sorted).
            top: dict[str, float] = {}
            for tid, lp in e.top:
                top.setdefault(self.token_text(tid), lp)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def chat_logprobs(entries: Sequence, token_text: Callable[[int], str]) -> dict:
    """The chat API's `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def item(tid: int, lp: float) -> dict:
        text = token_text(tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e.token_id, e.logprob),
                         "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]}
