"""The decoder-only transformer shared by every family, dense and MoE.

Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE and gpt-oss differ only by
their `ModelConfig`: a layer's feed-forward block is the dense `MLP` or, in MoE models,
`MoE` (`jaxinfer.models.moe`).

Input is one ragged batch of T new tokens (see `jaxinfer.ops.attention`); the KV
cache is a list with one (k_pages, v_pages) pair per layer, returned updated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.models.layers import MLP, Attention, RMSNorm
from jaxinfer.models.moe import MoE
from jaxinfer.ops.attention import AttentionMetadata
from jaxinfer.ops.linear_registry import linear
from jaxinfer.ops.rope import rope_inv_freq, rope_tables
from jaxinfer.sharding import P, reduce_over, shard_index, shard_map_logical


class DecoderLayer(nnx.Module):
    """x + attn(input_norm(x)), then + mlp(post_attn_norm(x)). A norm is an `RMSNorm` or, in
    front of float projections, a `FoldedRMSNorm` (its scale in their weights) that hands
    them x and 1 / rms(x) instead (`projection_input`); an MoE block's norm stays plain
    (its experts read the normalised input) and its router may hold the scale."""

    def __init__(self, config: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        self.attn = Attention(config, layer=layer, dtype=dtype, rngs=rngs)
        self.post_attn_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        self.mlp = (MoE(config, dtype=dtype, rngs=rngs) if config.is_moe_layer(layer)
                    else MLP(config, dtype=dtype, rngs=rngs))

    def __call__(self, x, rope, kv_pages, md):
        """x [T, hidden], rope: RoPE's (cos, sin) tables for the step's tokens."""
        x_in, row_scale = self.input_norm.projection_input(x)
        h, kv_pages = self.attn(x_in, rope, kv_pages, md, row_scale)
        x = x + h
        if isinstance(self.mlp, MoE):  # padding tokens must not route to experts
            live = jnp.arange(x.shape[0]) < md.cu_q_lens[md.num_seqs[0]]
            inv_rms = self.post_attn_norm.inv_rms(x)
            x_in = self.post_attn_norm.scaled(x, inv_rms)
            x = x + self.mlp(x_in, live, raw=(x, inv_rms))
        else:
            x_in, row_scale = self.post_attn_norm.projection_input(x)
            x = x + self.mlp(x_in, row_scale)
        return x, kv_pages


class Embedding(nnx.Module):
    """embedding [vocab, dim], its rows split over the vocabulary axis when sharded."""

    def __init__(self, vocab_size, dim, *, dtype, rngs: nnx.Rngs):
        self.embedding = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(),
                                                                 (vocab_size, dim), dtype),
                                   axes=P("vocab", "embed"))

    def __call__(self, token_ids):
        vocab = self.embedding.shape[0]

        def lookup(table, ids):
            if table.shape[0] == vocab:  # the whole table here
                return jnp.take(table, ids, axis=0)
            # Each device looks up the ids among its rows (zeros for the others); a psum joins.
            local = ids - shard_index("vocab") * table.shape[0]
            mine = (local >= 0) & (local < table.shape[0])
            rows = jnp.take(table, jnp.where(mine, local, 0), axis=0)
            return reduce_over(("vocab",), jnp.where(mine[:, None], rows, 0))

        return shard_map_logical(lookup, (P("vocab", "embed"), P("batch")), P("batch", "embed"),
                                 self.embedding[...], token_ids)


class Decoder(nnx.Module):
    """Checkpoint keys: embed.embedding, layers.{i}.*, final_norm.scale, lm_head (when untied).

    Built here with random weights (joined projections, plain norms); a loaded model comes
    from `jaxinfer.models.inference_form.inference_model`."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.embed = Embedding(config.vocab_size, config.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List(
            [DecoderLayer(config, i, dtype=dtype, rngs=rngs) for i in range(config.num_layers)])
        self.final_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nnx.Param(nnx.initializers.normal(0.02)(
                rngs.params(), (config.vocab_size, config.hidden_size), dtype),
                axes=P("vocab", "embed"))

    def __call__(self, token_ids: jax.Array, positions: jax.Array, kv_cache: list,
                 md: AttentionMetadata):
        """token_ids, positions [T] int32 -> (hidden [T, hidden_size], updated kv_cache)."""
        x = self.embed(token_ids)
        # RoPE's tables, once for all layers (per layer they cost a kernel each at decode).
        rope = rope_tables(positions, *rope_inv_freq(self.config), x.dtype)
        new_cache = []
        for layer, kv_pages in zip(self.layers, kv_cache, strict=True):
            x, kv_pages = layer(x, rope, kv_pages, md)
            new_cache.append(kv_pages)
        return self.final_norm(x), new_cache

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., hidden_size] -> float32 logits [..., vocab]."""
        w = self.embed.embedding[...] if self.lm_head is None else self.lm_head[...]
        return linear(hidden, w).astype(jnp.float32)
