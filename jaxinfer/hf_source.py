"""Reads an HF model directory: config.json, (sharded) safetensors, tokenizer files.

Tensors are yielded one at a time under our checkpoint keys (see
`jaxinfer.models.Decoder`), so a converter never holds the whole model.
Pickle weights (`pytorch_model.bin`) are never loaded.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from safetensors import safe_open

from jaxinfer.config import ModelConfig, config_from_hf, read_json
from jaxinfer.errors import JaxinferError
from jaxinfer.tokenizer import TOKENIZER_FILES

_LAYER_NAMES = {
    "input_layernorm.weight": "input_norm.scale",
    "post_attention_layernorm.weight": "post_attn_norm.scale",
    "self_attn.q_norm.weight": "attn.q_norm.scale",
    "self_attn.k_norm.weight": "attn.k_norm.scale",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


def hf_key(name: str) -> str | None:
    """HF tensor name -> our checkpoint key (None for tensors we do not use)."""
    if name == "model.embed_tokens.weight":
        return "embed.embedding"
    if name == "model.norm.weight":
        return "final_norm.scale"
    if name == "lm_head.weight":
        return "lm_head"
    m = _LAYER_RE.fullmatch(name)
    if m is None:
        return None
    layer, rest = m.groups()
    if rest in _LAYER_NAMES:
        rest = _LAYER_NAMES[rest]
    elif rest.startswith("self_attn."):
        rest = "attn." + rest.removeprefix("self_attn.")
    elif not rest.startswith("mlp."):
        return None  # e.g. self_attn.rotary_emb.inv_freq in old checkpoints
    return f"layers.{layer}.{rest}"


class HFSource:
    """An HF checkpoint directory."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise JaxinferError(f"{self.path}: not a directory")
        self.config: ModelConfig = config_from_hf(read_json(self.path / "config.json"),
                                                  str(self.path / "config.json"))
        gen = self.path / "generation_config.json"
        if gen.exists():
            eos = read_json(gen).get("eos_token_id")
            eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
            merged = tuple(dict.fromkeys([*self.config.eos_token_ids, *eos]))
            self.config = dataclasses.replace(self.config, eos_token_ids=merged)
        self.files = self._weight_files()

    def _weight_files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise JaxinferError(f"{index}: missing field 'weight_map'")
            files = [self.path / f for f in dict.fromkeys(weight_map.values())]
        else:
            files = sorted(self.path.glob("*.safetensors"))
        if not files:
            pickles = list(self.path.glob("*.bin")) + list(self.path.glob("*.pt"))
            hint = " (pickle weights are not loaded: save them as safetensors)" if pickles else ""
            raise JaxinferError(f"{self.path}: no *.safetensors weight files{hint}")
        for f in files:
            if not f.exists():
                raise JaxinferError(f"{f}: weight file listed in the index is missing")
        return files

    def tensors(self) -> Iterator[tuple[str, np.ndarray, str]]:
        """Yields (our key, array as stored, source file name), one tensor at a time."""
        for file in self.files:
            try:
                with safe_open(file, framework="numpy") as f:
                    for name in f.keys():
                        key = hf_key(name)
                        if key is not None:
                            yield key, f.get_tensor(name), file.name
            except JaxinferError:
                raise
            except Exception as e:  # safetensors raises its own types for bad files
                raise JaxinferError(f"{file}: truncated or corrupt safetensors file ({e})") \
                    from None

    def tokenizer_files(self) -> dict[str, bytes]:
        """The tokenizer and generation files present, by name."""
        return {n: (self.path / n).read_bytes() for n in TOKENIZER_FILES
                if (self.path / n).exists()}

