"""Tokenizer: a `tokenizers` tokenizer plus the checkpoint's chat template.

The chat template is rendered with jinja2 in a sandboxed environment (templates
come from checkpoints, which are untrusted input).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jaxinfer.errors import JaxinferError

# The tokenizer and generation files a checkpoint carries (copied as they are by `convert`).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json", "special_tokens_map.json")


def _token_text(value):
    """tokenizer_config.json stores special tokens as strings or AddedToken dicts."""
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    def __init__(self, tokenizer, chat_template: str | None = None,
                 bos_token: str | None = None, eos_token: str | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
        """Loads tokenizer.json, tokenizer_config.json and chat_template.jinja from a directory."""
        path = Path(path)
        return cls.from_files({n: (path / n).read_bytes() for n in TOKENIZER_FILES
                               if (path / n).exists()}, path)

    @classmethod
    def from_files(cls, files: dict[str, bytes], where: Path) -> Tokenizer:
        """From tokenizer file contents by name (`where` names their place in errors)."""
        from tokenizers import Tokenizer as HFTokenizer

        if "tokenizer.json" not in files:
            raise JaxinferError(f"{where}: no tokenizer.json (the checkpoint has no tokenizer)")
        try:
            tok = HFTokenizer.from_str(files["tokenizer.json"].decode())
        except Exception as e:
            raise JaxinferError(f"{where}/tokenizer.json: cannot load tokenizer ({e})") from None
        cfg = {}
        if "tokenizer_config.json" in files:
            try:
                cfg = json.loads(files["tokenizer_config.json"])
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise JaxinferError(f"{where}/tokenizer_config.json: not valid JSON ({e})") \
                    from None
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if "chat_template.jinja" in files:
            template = files["chat_template.jinja"].decode()
        return cls(tok, template, _token_text(cfg.get("bos_token")),
                   _token_text(cfg.get("eos_token")))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Renders messages [{"role", "content"}] with the checkpoint's template."""
        if not self.chat_template:
            raise JaxinferError("the checkpoint has no chat template (tokenizer_config.json)")
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise JaxinferError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
            x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError as e:
            raise JaxinferError(f"chat template: {e}") from None


class IncrementalDecoder:
    """Turns a growing list of output token ids into text deltas.

    Each step decodes only a short window: a few already-emitted tokens as context
    (starting with the prompt's tail), then the new ones, and emits the text past
    the context. The context keeps tokenizers that drop a leading space at the
    start of a decode (SentencePiece) from eating the first space, and the window
    keeps each step O(1). A byte-level tokenizer can end a step in the middle of a
    multi-byte character: the text then ends in U+FFFD and is held back until the
    character is complete.
    """

    CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids=(), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids)[-self.CONTEXT:]
        self.prefix_offset = 0  # start of the context window
        self.read_offset = len(self.ids)  # tokens before this are emitted

    def push(self, token_ids) -> str:
        self.ids.extend(token_ids)
        decode = self._decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset])
        text = decode(self.ids[self.prefix_offset:])
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return text[len(prefix):]

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def text_of(self, token_ids) -> str:
        """All of token_ids' text at once (the same text the deltas add up to)."""
        return "".join(self.push([t]) for t in token_ids) + self.flush()

    def flush(self) -> str:
        """Whatever is held back (an incomplete character at the very end)."""
        decode = self._decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset])
        text = decode(self.ids[self.prefix_offset:])
        self.read_offset = len(self.ids)
        return text[len(prefix):]
