"""Random-weight models of named shapes, built directly on the device (no checkpoint needed),
so large-model performance can be measured without weights.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.errors import JaxinferError
from jaxinfer.loading.checkpoint import ConvertedCheckpoint, PlacedWeights, model_placer
from jaxinfer.models import Decoder
from jaxinfer.models.inference_form import OFFSET, SCALE, checkpoint_layout, inference_model
from jaxinfer.models.layers import is_quantizable
from jaxinfer.ops.quant import QuantFormat, QuantizedWeight, parse_format
from jaxinfer.ops.quant import quantize as quantize_weight
from jaxinfer.sharding import MeshSpec

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

PRESETS: dict[str, ModelConfig] = {
    "llama3-8b": ModelConfig(
        family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE, eos_token_ids=(128001,)),
    "llama3-70b": ModelConfig(
        family="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
        num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE, eos_token_ids=(128001,)),
    "qwen3-8b": ModelConfig(
        family="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
        qk_norm=True, eos_token_ids=(151645,)),
    "qwen3-30b-a3b": ModelConfig(
        family="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
        qk_norm=True, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        norm_topk_prob=True, eos_token_ids=(151645,)),
    "mixtral-8x7b": ModelConfig(
        family="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336,
        eos_token_ids=(2,)),
    "gpt-oss-20b": ModelConfig(
        family="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
        num_layers=24, num_heads=64, num_kv_heads=8, head_dim=64,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=150000.0,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                      "truncate": False, "original_max_position_embeddings": 4096},
        qkv_bias=True, o_bias=True, sliding_window=128, sliding_layers=tuple(range(0, 24, 2)),
        attention_sinks=True, num_experts=32, num_experts_per_tok=4,
        moe_intermediate_size=2880, router_bias=True, expert_bias=True,
        activation="gpt_oss", eos_token_ids=(200002,)),
    # A tiny MoE (CPU smoke tests of the MoE path).
    "tiny-moe": ModelConfig(
        family="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024,
        qk_norm=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        eos_token_ids=(1,)),
    # Small enough for CPU smoke tests.
    "tiny": ModelConfig(
        family="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024,
        eos_token_ids=(1,)),
}


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise JaxinferError(f"--preset {name!r}: expected one of {', '.join(PRESETS)}")
    return PRESETS[name]


def random_model(config: ModelConfig, dtype=jnp.bfloat16, seed: int = 0,
                 mesh: jax.sharding.Mesh | None = None, quantize: str | None = None) -> Decoder:
    """A Decoder with random weights generated on the device(s) (`RandomWeights`)."""
    return RandomWeights(config, dtype, seed, mesh, quantize).load()


class RandomWeights(PlacedWeights):
    """Random weights of a model of `config`, generated on the device(s), one parameter at a
    time, each straight into its shards on `mesh` (default: the first device). The same
    seed gives the same model on any mesh. Like a converted checkpoint, they are described
    before they exist (`abstract_model`), so a runner's programs compile while they are made
    (`load_in_background`).

    Matrices ~ N(0, 0.02^2); norm scales ~ 1 + N(0, 0.02^2) (never zeros). `quantize`
    (a `jaxinfer.ops.quant.parse_format` spelling): the decoder-block projections are then
    quantized to it on the device, as `jaxinfer convert --quantize` would store them. The
    model is built from those checkpoint tensors as a loaded one is (`inference_model`).
    """

    def __init__(self, config: ModelConfig, dtype=jnp.bfloat16, seed: int = 0,
                 mesh: jax.sharding.Mesh | None = None, quantize: str | None = None):
        self.fmt = parse_format(quantize) if quantize else None
        self.dtype, self.seed = jnp.dtype(dtype), seed
        self.config = config
        super().__init__(model_placer(config, mesh or MeshSpec().meshes()[0]), {})
        self.layout = checkpoint_layout(config)
        # What the generation gives, known by its trace alone (a quantization that cannot
        # take a tensor raises here).
        for name, layout in self.layout.items():
            for key, aval in jax.eval_shape(
                    lambda name=name, layout=layout: self._tensors(0, name, layout)).items():
                self._stored[key] = jax.ShapeDtypeStruct(
                    aval.shape, aval.dtype, sharding=self.placer.sharding(key, aval.shape))

    def _tensors(self, index: int, name: str, layout) -> dict[str, jax.Array]:
        """Tensor `name` (the index-th of the layout) as generated: key -> array (the values,
        scales and offsets of a quantized projection)."""
        shape = layout.shape
        array = _random(jax.random.fold_in(jax.random.key(self.seed), index), shape,
                        self.dtype, self.placer.sharding(name, shape))
        if self.fmt is None or not is_quantizable(name):
            return {name: array}
        try:
            w = _quantized(array, self.fmt)
        except JaxinferError as e:
            raise JaxinferError(f"--quantize {self.fmt}: tensor {name}: {e}") from None
        parts = {name: w.values, name + SCALE: w.scales, name + OFFSET: w.offsets}
        return {k: a for k, a in parts.items() if a is not None}

    def describe(self) -> dict:
        return {"random": json.loads(self.config.to_json()), "dtype": self.dtype.name,
                "seed": self.seed, "quantize": None if self.fmt is None else str(self.fmt)}

    def _read(self) -> dict[str, jax.Array]:
        params = {}
        for i, (name, layout) in enumerate(self.layout.items()):
            for key, array in self._tensors(i, name, layout).items():
                params[key] = self.placer.place(key, array)
        return params

    def _build(self, params: dict) -> Decoder:
        config = self.placer.model_config
        if self.fmt is not None:
            config = dataclasses.replace(config, quantization=str(self.fmt))
        return inference_model(config, params, self.fmt.activations if self.fmt else None)


@functools.partial(jax.jit, static_argnums=1)
def _quantized(w: jax.Array, fmt: QuantFormat) -> QuantizedWeight:
    """`jaxinfer.ops.quant.quantize` of W [N, K] or of each matrix of a stack [E, N, K]."""
    if w.ndim == 3:
        return jax.vmap(lambda we: quantize_weight(we, fmt))(w)
    return quantize_weight(w, fmt)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _random(key, shape, dtype, sharding):
    offset = 1.0 if len(shape) == 1 else 0.0
    x = (offset + 0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    return jax.lax.with_sharding_constraint(x, sharding)


def weights_from(description: dict, mesh: jax.sharding.Mesh) -> PlacedWeights:
    """The weights a `PlacedWeights.describe()` describes, placed on `mesh`."""
    if "converted" in description:
        return ConvertedCheckpoint(Path(description["converted"]), description["dtype"], mesh)
    return RandomWeights(ModelConfig.from_dict(description["random"]),
                         jnp.dtype(description["dtype"]), description["seed"], mesh,
                         description["quantize"])
