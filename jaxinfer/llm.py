"""The library entry point: `LLM(path).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

from jaxinfer.checkpoint import is_converted, load_model, open_source
from jaxinfer.engine import Engine, Request
from jaxinfer.errors import JaxinferError
from jaxinfer.models import Decoder
from jaxinfer.runner import ModelRunner, SeqChunk
from jaxinfer.sampling import SamplingParams
from jaxinfer.tokenizer import IncrementalDecoder, Tokenizer


@dataclasses.dataclass
class RequestOutput:
    prompt: str | list[int]
    text: str
    token_ids: list[int]
    finish_reason: str


class LLM:
    """Loads a model (converted dir, HF dir or .gguf; None = the embedded SmolLM2) and generates.

    kv_cache_bytes sizes the paged KV cache; max_model_len defaults to the
    model's context, capped by what the cache holds.
    """

    def __init__(self, model: str | Path | Decoder | None = None, *, dtype: str | None = None,
                 page_size: int = 16, kv_cache_bytes: int = 1 << 30,
                 max_model_len: int | None = None, max_num_seqs: int = 8,
                 max_num_batched_tokens: int = 512):
        if isinstance(model, Decoder):  # e.g. a random-weight preset (jaxinfer.presets)
            self.path, self.model, self.tokenizer = None, model, None
        else:
            if model is None:
                from jaxinfer.default_model import default_model_path
                model = default_model_path()
            self.path = Path(model)
            if is_converted(self.path):
                self.model, files = load_model(self.path, dtype=dtype), None
            else:  # one read of the source for both weights and tokenizer
                source = open_source(self.path)
                self.model, files = load_model(source, dtype=dtype), source.tokenizer_files()
            if files is None and (self.path / "tokenizer.json").exists():
                self.tokenizer = Tokenizer.from_dir(self.path)
            elif files and "tokenizer.json" in files:
                self.tokenizer = Tokenizer.from_files(files, self.path)
            else:
                self.tokenizer = None  # token-id prompts only
        self.config = c = self.model.config
        itemsize = self.model.embed.embedding.dtype.itemsize
        page_bytes = 2 * c.num_layers * page_size * c.num_kv_heads * c.head_dim * itemsize
        num_pages = max(kv_cache_bytes // page_bytes, 1)
        self.max_model_len = min(max_model_len or c.max_position_embeddings,
                                 num_pages * page_size)
        runner = ModelRunner(self.model, num_pages, page_size, self.max_model_len)
        self.engine = Engine(runner, c.eos_token_ids, self.max_model_len, max_num_seqs,
                             max_num_batched_tokens)

    @property
    def runner(self) -> ModelRunner:
        return self.engine.runner

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
        req = self.engine.add_request(self._prompt_ids(prompt), params or SamplingParams())
        return self._stream(req)

    def _stream(self, req: Request) -> Iterator[str]:
        decoder = IncrementalDecoder(self.tokenizer, req.prompt_ids)
        try:
            while not req.finished:
                for r, tokens in self.engine.step():
                    if r is req:
                        delta = decoder.push(self._visible(r, tokens))
                        if delta:
                            yield delta
            if tail := decoder.flush():
                yield tail
        finally:
            self.engine.abort(req)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Token ids of messages rendered with the checkpoint's chat template."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def logits(self, prompts: list[list[int]]) -> list:
        """float32 logits [len(prompt), vocab] for every position of each prompt (one prefill)."""
        page_size = self.runner.page_size
        chunks = []
        try:
            for ids in prompts:
                if len(ids) > self.max_model_len:
                    raise JaxinferError(f"prompt has {len(ids)} tokens; max_model_len is "
                                        f"{self.max_model_len}")
                pages = self.engine.allocator.allocate(-(-len(ids) // page_size))
                if pages is None:
                    raise JaxinferError("the KV cache is too small for these prompts")
                chunks.append(SeqChunk(new_tokens=list(ids), num_cached=0, pages=pages))
            return self.runner.logits(chunks)
        finally:
            for c in chunks:
                self.engine.allocator.release(c.pages)

    def _visible(self, req: Request, tokens: list[int]) -> list[int]:
        """Drops a final stop token from the text (it stays in token_ids)."""
        if req.finish_reason == "stop":
            return tokens[:-1]
        return tokens

    def _output(self, prompt, req: Request) -> RequestOutput:
        text_ids = self._visible(req, req.output_ids)
        text = (IncrementalDecoder(self.tokenizer, req.prompt_ids).text_of(text_ids)
                if self.tokenizer else "")
        return RequestOutput(prompt, text, list(req.output_ids), req.finish_reason)

