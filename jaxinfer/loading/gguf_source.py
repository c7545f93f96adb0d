"""Reads a GGUF file: metadata -> ModelConfig, tensors, and the embedded tokenizer
rebuilt as a `tokenizers` tokenizer.

Tensors are either dequantized with the `gguf` package, or, for the decoder-block
projections stored as Q4_0 / Q4_1 / Q8_0, imported as they are (`native=True`):
their blocks are decoded here into a `QuantizedWeight` with group size 32, bit for bit
(the same f16 scales, the same integers):

  Q4_0  f16 d, 16 bytes of nibbles  W = d * (q - 8)        -> int4 values q - 8, scales d
  Q4_1  f16 d, f16 m, 16 bytes      W = d * q + m          -> int4 values q - 8, scales d,
                                                               offsets m + 8 d (float32)
  Q8_0  f16 d, 32 int8              W = d * q              -> int8 values q, scales d

(byte j of a 4-bit block holds element j in its low nibble and element j + 16 in
its high one). Every other tensor type is dequantized.

GGUF quirks handled here: ggml stores shapes innermost-first (numpy order is
the reverse, which the gguf reader already gives), and llama.cpp permutes the
rows of Llama's q/k projections for its interleaved RoPE, which we undo so the
weights match HF's `rotate_half` convention (on the values' rows and the scales'
and offsets' N axis for quantized tensors).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from jaxinfer.config import ModelConfig, config_from_gguf
from jaxinfer.errors import JaxinferError
from jaxinfer.models.layers import is_quantizable
from jaxinfer.ops.quant import QuantizedWeight

_GLOBAL_NAMES = {
    "token_embd.weight": "embed.embedding",
    "output_norm.weight": "final_norm.scale",
    "output.weight": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_norm.scale",
    "ffn_norm.weight": "post_attn_norm.scale",
    "attn_q.weight": "attn.q_proj.weight",
    "attn_k.weight": "attn.k_proj.weight",
    "attn_v.weight": "attn.v_proj.weight",
    "attn_output.weight": "attn.o_proj.weight",
    "attn_q.bias": "attn.q_proj.bias",
    "attn_k.bias": "attn.k_proj.bias",
    "attn_v.bias": "attn.v_proj.bias",
    "attn_q_norm.weight": "attn.q_norm.scale",
    "attn_k_norm.weight": "attn.k_norm.scale",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")

# llama.cpp pre-tokenizer names -> the split regex they stand for.
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
                 r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
_QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
_PRE_TOKENIZERS = {"gpt2": _GPT2_SPLIT, "smollm": _GPT2_SPLIT, "default": _GPT2_SPLIT,
                   "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED = 3, 4


def gguf_key(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.fullmatch(name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's per-head row permutation of q/k projection weights."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray | QuantizedWeight, n_heads: int) -> np.ndarray | QuantizedWeight:
    if not isinstance(w, QuantizedWeight):
        return _unpermute_rows(w, n_heads)
    offsets = None if w.offsets is None else _unpermute_rows(w.offsets.T, n_heads).T
    return QuantizedWeight(_unpermute_rows(w.values, n_heads),
                           _unpermute_rows(w.scales.T, n_heads).T, offsets, w.activations)


QK = 32  # elements per Q4_0 / Q4_1 / Q8_0 block
# The ggml types imported without dequantizing -> bytes per block of 32 elements.
NATIVE_TYPES = {"Q4_0": 2 + QK // 2, "Q4_1": 4 + QK // 2, "Q8_0": 2 + QK}


def decode_blocks(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedWeight:
    """Raw Q4_0 / Q4_1 / Q8_0 bytes of a [N, K] tensor -> QuantizedWeight (group 32, exact).

    Values and scales (and Q4_1's offsets) are numpy arrays: int4 / int8 values
    [N, K], float32 scales [K // 32, N].
    """
    import ml_dtypes

    n, k = shape
    if k % QK:
        raise ValueError(f"{type_name} tensor with {k} columns (not a multiple of {QK})")
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(n, k // QK, NATIVE_TYPES[type_name])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, G]
    offsets = None
    if type_name == "Q8_0":
        values = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
    else:
        qs = blocks[..., 4:] if type_name == "Q4_1" else blocks[..., 2:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int8) - 8  # [N, G, 32]
        values = q.reshape(n, k).astype(ml_dtypes.int4)
        if type_name == "Q4_1":
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            offsets = np.ascontiguousarray((m + np.float32(8) * d).T)
    return QuantizedWeight(values, np.ascontiguousarray(d.T), offsets)


class _ShortFile(Exception):
    """A read past the end of a GGUF file; the message says what needed how many bytes where."""


def _read_gguf(path: Path):
    """A `gguf.GGUFReader` of `path` that raises _ShortFile at the first read past the file's end.

    The stock reader slices its memmap without a bounds check, so a truncated file gets short
    arrays and fails later in numpy, with a message about dtypes or shapes.
    """
    import gguf

    class CheckedReader(gguf.GGUFReader):
        # What the reader is reading, for the message: it reads the fixed header, then the
        # key/value metadata, then one info record per tensor, then the tensors' data.
        reading = "the header"
        tensor_at: dict[int, str] = {}  # data offset -> tensor name

        def _build_fields(self, offs, count):
            self.reading = "the metadata"
            return super()._build_fields(offs, count)

        def _build_tensor_info(self, offs, count):
            self.reading = "the tensor list"
            return super()._build_tensor_info(offs, count)

        def _build_tensors(self, start_offs, fields):
            self.tensor_at = {int(start_offs) + int(f.parts[-1][0]): f.name for f in fields}
            return super()._build_tensors(start_offs, fields)

        def _get(self, offset, dtype, count=1, override_order=None):
            offset, size = int(offset), len(self.data)
            nbytes = np.dtype(dtype).itemsize * int(count)
            if offset + nbytes > size:
                name = self.tensor_at.get(offset)
                what = f"tensor {name}" if name is not None else self.reading
                raise _ShortFile(f"{what} needs {nbytes} bytes at offset {offset}, "
                                 f"the file has {size}")
            return super()._get(offset, dtype, count, override_order)

    return CheckedReader(path)


class GGUFSource:
    """A .gguf file (llama, mistral, qwen2, qwen3 architectures)."""

    native_quantization = "gguf"  # the ModelConfig.quantization of its own quantized tensors

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self.reader = _read_gguf(self.path)
            self.meta = {k: f.contents() for k, f in self.reader.fields.items()
                         if not k.startswith("GGUF.")}
        except FileNotFoundError:
            raise JaxinferError(f"{self.path}: file not found") from None
        except _ShortFile as e:
            raise JaxinferError(f"{self.path}: truncated or corrupt GGUF file: {e}") from None
        except Exception as e:  # gguf raises ValueError/IndexError/... on damaged files
            raise JaxinferError(f"{self.path}: truncated or corrupt GGUF file ({e})") from None
        names = {t.name for t in self.reader.tensors}
        if "rope_freqs.weight" in names:
            raise JaxinferError(f"{self.path}: rope_freqs.weight (llama3 RoPE scaling stored as a "
                                "tensor) is not supported yet; convert the HF directory instead")
        self.config: ModelConfig = config_from_gguf(self.meta, str(self.path),
                                                    has_output_tensor="output.weight" in names)

    def tensors(self, native: bool = True
                ) -> Iterator[tuple[str, np.ndarray | QuantizedWeight, str]]:
        """Yields (our key, array, file name), one tensor at a time.

        Arrays are float32 (dequantized), except, with `native`, the decoder-block
        projections stored as Q4_0 / Q4_1 / Q8_0: `QuantizedWeight`s decoded from the
        blocks as they are (see the module docstring).
        """
        from gguf.quants import dequantize

        permute = self.config.family in ("llama", "mistral")
        for t in self.reader.tensors:
            key = gguf_key(t.name)
            if key is None:
                continue
            type_name = t.tensor_type.name
            try:
                if native and type_name in NATIVE_TYPES and is_quantizable(key):
                    shape = tuple(int(d) for d in reversed(t.shape))  # ggml: innermost first
                    w = decode_blocks(t.data, type_name, shape)
                else:
                    w = dequantize(t.data, t.tensor_type)
            except Exception as e:
                raise JaxinferError(f"{self.path}: cannot read tensor {t.name} ({e})") from None
            if permute and key.endswith("attn.q_proj.weight"):
                w = _unpermute(w, self.config.num_heads)
            elif permute and key.endswith("attn.k_proj.weight"):
                w = _unpermute(w, self.config.num_kv_heads)
            yield key, w, self.path.name

    def tokenizer_files(self) -> dict[str, bytes]:
        """tokenizer.json and tokenizer_config.json rebuilt from the embedded tokenizer."""
        tok = self._build_tokenizer()
        tokens = self.meta["tokenizer.ggml.tokens"]

        def token(key):
            i = self.meta.get(key)
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        tok_config = {
            "bos_token": token("tokenizer.ggml.bos_token_id"),
            "eos_token": token("tokenizer.ggml.eos_token_id"),
            "chat_template": self.meta.get("tokenizer.chat_template"),
        }
        return {"tokenizer.json": tok.to_str().encode(),
                "tokenizer_config.json": json.dumps(tok_config, indent=2).encode()}

    def _build_tokenizer(self):
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
        from tokenizers.processors import TemplateProcessing

        kind = self.meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise JaxinferError(f"{self.path}: tokenizer.ggml.model={kind!r} is not supported "
                                "(only byte-level BPE, 'gpt2'); convert the HF directory instead")
        pre = self.meta.get("tokenizer.ggml.pre", "default")
        if pre not in _PRE_TOKENIZERS:
            raise JaxinferError(f"{self.path}: tokenizer.ggml.pre={pre!r} is not supported")
        tokens = self.meta["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ", 1)) for m in self.meta["tokenizer.ggml.merges"]]
        # Llama 3's BPE takes a pre-token that is itself in the vocabulary whole (as HF's
        # tokenizer.json and llama.cpp do).
        tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges,
                                   fuse_unk=False, byte_fallback=False,
                                   ignore_merges=pre in ("llama-bpe", "llama3")))
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PRE_TOKENIZERS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        tok.decoder = decoders.ByteLevel()
        types = self.meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        typed = list(zip(tokens, types, strict=True))
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in typed if ty == _TOKEN_TYPE_CONTROL])
        tok.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in typed if ty == _TOKEN_TYPE_USER_DEFINED])
        bos = self.meta.get("tokenizer.ggml.bos_token_id")
        if self.meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
            tok.post_processor = TemplateProcessing(
                single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B",
                special_tokens=[(tokens[bos], bos)])
        return tok

