"""Model configuration: one dataclass for every decoder family, dense and MoE.

Families (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss)
differ only by the fields below; the decoder in `jaxinfer.models` reads nothing
else. A config is built from an HF `config.json` dict or from GGUF metadata and
stored as JSON in converted checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jaxinfer.errors import JaxinferError

# HF `architectures[0]` / `model_type` -> our family name.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GptOssForCausalLM": "gpt_oss",
}
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
# rope_type -> the rope_scaling keys it needs.
ROPE_KEYS = {"default": (), "linear": ("factor",), "yarn": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                        "original_max_position_embeddings")}


def read_json(path: Path) -> dict:
    """A JSON object from a file, or a one-line JaxinferError naming the file."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise JaxinferError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise JaxinferError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise JaxinferError(f"{path}: expected a JSON object")
    return data


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # HF `rope_scaling` / `rope_parameters` minus `rope_theta`; None = plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2, Llama `attention_bias`
    o_bias: bool = False  # Llama `attention_bias` also biases o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k
    sliding_window: int | None = None
    # The layers that use `sliding_window`; None: all of them (Mistral). gpt-oss alternates.
    sliding_layers: tuple[int, ...] | None = None
    attention_sinks: bool = False  # gpt-oss: one learned softmax-denominator logit per head
    # Mixture of experts (num_experts > 0): each MoE layer routes a token to its top
    # `num_experts_per_tok` experts, SwiGLU MLPs of `moe_intermediate_size`.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    # True: the top-k weights are a softmax over the chosen k logits (Mixtral, gpt-oss,
    # Qwen3-MoE); False: the top-k entries of the softmax over all experts (Qwen2-MoE).
    norm_topk_prob: bool = True
    router_bias: bool = False  # gpt-oss
    expert_bias: bool = False  # gpt-oss: biases on the experts' projections
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a sigmoid-gated shared expert
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model with a dense MLP instead
    # "silu": down(silu(gate) * up); "gpt_oss": gate and up clamped to `swiglu_limit`,
    # down((up + 1) * gate * sigmoid(swiglu_alpha * gate)).
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # How `jaxinfer convert` quantized the decoder-block projections: a
    # `jaxinfer.ops.quant.parse_format` spelling ("int8", "int4:g128", "fp8", ...), "gguf"
    # (a GGUF's own Q4_0 / Q4_1 / Q8_0 tensors kept as they are), or None (all float).
    quantization: str | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise JaxinferError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ROPE_KEYS:
            raise JaxinferError(f"rope_scaling.rope_type={rope_type!r} is not supported")
        missing = [k for k in ROPE_KEYS[rope_type] if k not in self.rope_scaling]
        if missing:
            raise JaxinferError(f"rope_scaling ({rope_type}) is missing {', '.join(missing)}")
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts
                                     and self.moe_intermediate_size > 0):
            raise JaxinferError(
                f"num_experts={self.num_experts} needs 0 < num_experts_per_tok <= num_experts "
                f"(got {self.num_experts_per_tok}) and moe_intermediate_size > 0 "
                f"(got {self.moe_intermediate_size})")
        if self.activation not in ("silu", "gpt_oss"):
            raise JaxinferError(f"activation={self.activation!r}: expected 'silu' or 'gpt_oss'")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer not in self.dense_layers

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None: full attention)."""
        if self.sliding_layers is not None and layer not in self.sliding_layers:
            return None
        return self.sliding_window

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """One token's keys and values in every layer's cache, `itemsize` bytes an element."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json_file(cls, path: Path) -> ModelConfig:
        return cls.from_dict(read_json(path), path)

    @classmethod
    def from_dict(cls, d: dict[str, Any], path: Path | str = "the config") -> ModelConfig:
        """The config of `to_json`'s fields (path: where they came from, for errors)."""
        d = dict(d)
        fields = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(d) - fields):
            raise JaxinferError(f"{path}: unknown field {unknown[0]!r}")
        for key in ("eos_token_ids", "dense_layers", "sliding_layers"):
            if isinstance(d.get(key), list):
                d[key] = tuple(d[key])
        try:
            return cls(**d)
        except TypeError as e:  # a required field is missing
            raise JaxinferError(f"{path}: {e}") from None


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list | tuple) else (int(value),)


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Builds a ModelConfig from an HF `config.json` dict (transformers 4.x or 5.x)."""
    archs = d.get("architectures") or []
    family = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if family is None:
        raise JaxinferError(
            f"{source}: architectures={archs} is not supported "
            f"(supported: {', '.join(sorted(HF_ARCHITECTURES))})"
        )

    def need(key):
        if key not in d:
            raise JaxinferError(f"{source}: missing field {key!r}")
        return d[key]

    num_heads = need("num_attention_heads")
    hidden = need("hidden_size")
    # transformers 5 moved rope_theta / rope_scaling into `rope_parameters`.
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    rope_theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    if rope.get("rope_type", "default") == "default":
        rope = {}
    sliding_window = d.get("sliding_window")
    sliding_layers = None
    if family == "gpt_oss":
        types = d.get("layer_types") or [
            "sliding_attention" if i % 2 == 0 else "full_attention"
            for i in range(need("num_hidden_layers"))]
        sliding_layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    elif family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        # Qwen declares a window but only uses it when use_sliding_window is set, and then
        # only in some layers (max_window_layers / layer_types): not supported yet.
        if d.get("use_sliding_window"):
            raise JaxinferError(f"{source}: use_sliding_window=true (a per-layer window) is not "
                                "supported yet")
        sliding_window = None
    attention_bias = bool(d.get("attention_bias", False))
    num_layers = need("num_hidden_layers")
    moe = _moe_fields(family, d, num_layers, need)
    return ModelConfig(
        family=family,
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        intermediate_size=need("intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=d.get("num_key_value_heads") or num_heads,
        head_dim=d.get("head_dim") or hidden // num_heads,
        max_position_embeddings=d.get("max_position_embeddings", 4096),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        rope_scaling=rope or None,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=(bool(d.get("qkv_bias", True)) if family == "qwen2_moe"
                  else family == "qwen2" or attention_bias),
        o_bias=family in ("llama", "mistral", "gpt_oss") and attention_bias,
        mlp_bias=bool(d.get("mlp_bias", False)),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        sliding_window=sliding_window,
        sliding_layers=sliding_layers,
        attention_sinks=family == "gpt_oss",
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=_ids(d.get("eos_token_id")),
        **moe,
    )


def _moe_fields(family: str, d: dict, num_layers: int, need) -> dict[str, Any]:
    """The MoE fields of an HF config (empty for dense families)."""
    if family == "mixtral":
        return dict(num_experts=need("num_local_experts"),
                    num_experts_per_tok=need("num_experts_per_tok"),
                    moe_intermediate_size=need("intermediate_size"))
    if family == "gpt_oss":
        return dict(num_experts=need("num_local_experts"),
                    num_experts_per_tok=need("num_experts_per_tok"),
                    moe_intermediate_size=need("intermediate_size"), router_bias=True,
                    expert_bias=True, activation="gpt_oss",
                    swiglu_alpha=float(d.get("swiglu_alpha", 1.702)),
                    swiglu_limit=float(d.get("swiglu_limit", 7.0)))
    if family in ("qwen2_moe", "qwen3_moe"):
        # A layer is sparse unless listed in mlp_only_layers, every decoder_sparse_step-th.
        step = d.get("decoder_sparse_step", 1) or 1
        only_mlp = set(d.get("mlp_only_layers") or ())
        dense = tuple(i for i in range(num_layers) if i in only_mlp or (i + 1) % step)
        # Qwen's own configs say num_experts; transformers 5 writes num_local_experts.
        experts = d.get("num_experts") or need("num_local_experts")
        return dict(num_experts=experts,
                    num_experts_per_tok=need("num_experts_per_tok"),
                    moe_intermediate_size=need("moe_intermediate_size"),
                    norm_topk_prob=bool(d.get("norm_topk_prob", family == "qwen3_moe")),
                    shared_expert_intermediate_size=d.get("shared_expert_intermediate_size", 0)
                    if family == "qwen2_moe" else 0,
                    dense_layers=dense)
    return {}


def config_from_gguf(meta: dict[str, Any], source: str, has_output_tensor: bool) -> ModelConfig:
    """Builds a ModelConfig from GGUF key/value metadata (already decoded to Python values)."""
    arch = meta.get("general.architecture")
    family = GGUF_ARCHITECTURES.get(arch)
    if family is None:
        raise JaxinferError(f"{source}: general.architecture={arch!r} is not supported")

    def need(key):
        full = f"{arch}.{key}"
        if full not in meta:
            raise JaxinferError(f"{source}: missing GGUF field {full!r}")
        return meta[full]

    num_heads = need("attention.head_count")
    hidden = need("embedding_length")
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    rope = None
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling == "linear":
        rope = {"rope_type": "linear", "factor": meta[f"{arch}.rope.scaling.factor"]}
    elif scaling == "yarn":
        rope = {
            "rope_type": "yarn",
            "factor": meta[f"{arch}.rope.scaling.factor"],
            "original_max_position_embeddings": meta[
                f"{arch}.rope.scaling.original_context_length"
            ],
        }
    elif scaling not in (None, "none"):
        raise JaxinferError(f"{source}: {arch}.rope.scaling.type={scaling!r} is not supported")
    return ModelConfig(
        family=family,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=need("feed_forward_length"),
        num_layers=need("block_count"),
        num_heads=num_heads,
        num_kv_heads=meta.get(f"{arch}.attention.head_count_kv") or num_heads,
        head_dim=meta.get(f"{arch}.attention.key_length") or hidden // num_heads,
        max_position_embeddings=need("context_length"),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope,
        tie_word_embeddings=not has_output_tensor,
        qkv_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        sliding_window=meta.get(f"{arch}.attention.sliding_window"),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_ids(meta.get("tokenizer.ggml.eos_token_id")),
    )
