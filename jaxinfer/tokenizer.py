"""Tokenizer: a `tokenizers` tokenizer plus the checkpoint's chat template.

The chat template is rendered with jinja2 in a sandboxed environment (templates
come from checkpoints, which are untrusted input).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jaxinfer.errors import JaxinferError


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
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.exists():
            raise JaxinferError(f"{tok_file}: file not found (the checkpoint has no tokenizer)")
        try:
            tok = HFTokenizer.from_file(str(tok_file))
        except Exception as e:
            raise JaxinferError(f"{tok_file}: cannot load tokenizer ({e})") from None
        cfg = {}
        if (path / "tokenizer_config.json").exists():
            try:
                cfg = json.loads((path / "tokenizer_config.json").read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise JaxinferError(f"{path / 'tokenizer_config.json'}: not valid JSON ({e})") \
                    from None
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        return cls(tok, template, _token_text(cfg.get("bos_token")),
                   _token_text(cfg.get("eos_token")))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

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
    """Turns a growing list of token ids into text deltas, never splitting a UTF-8 character.

    A byte-level tokenizer can end a step in the middle of a multi-byte
    character; the decoded text then ends in U+FFFD, and we hold it back until
    the character is complete.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token_ids) -> str:
        self.ids.extend(token_ids)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        delta = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted = text
        return delta
