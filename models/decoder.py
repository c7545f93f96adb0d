"""The decoder-only transformer shared by every family, dense and MoE.

Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE and gpt-oss differ only by
their `ModelConfig`: a layer's feed-forward block is the dense `MLP` or, in MoE models,
`MoE` (`jaxinfer.models.moe`).

Input is one ragged batch of T new tokens (see `jaxinfer.ops.attention`); the KV
cache is a list of (k_pages, v_pages) pairs, returned updated: one pair per layer, or, once
`scan_layers` has stacked the layers, one pool per position in a scanned group
(`Decoder.kv_cache_pools`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.models.layers import MLP, Attention, RMSNorm, new_param
from jaxinfer.models.moe import MoE
from jaxinfer.ops.attention import AttentionMetadata
from jaxinfer.ops.linear_registry import linear
from jaxinfer.ops.rope import rope_inv_freq, rope_tables
from jaxinfer.sharding import P, reduce_over, shard_index, shard_map_logical


class DecoderLayer(nnx.Module):
    """x + attn(input_norm(x)), then + mlp(post_attn_norm(x)). A norm is an `RMSNorm` or, in
    front of float projections, a `FoldedRMSNorm` (its scale in their weights) that hands
    them x and its `RowNorm` instead (`projection_input`: they scale their rows by its
    1 / rms); an MoE block's norm stays plain (its experts read the normalised input) and
    its router may hold the scale."""

    def __init__(self, config: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        self.attn = Attention(config, layer=layer, dtype=dtype, rngs=rngs)
        self.post_attn_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        self.mlp = (MoE(config, dtype=dtype, rngs=rngs) if config.is_moe_layer(layer)
                    else MLP(config, dtype=dtype, rngs=rngs))

    def __call__(self, x, rope, kv_pages, md):
        """x [T, hidden], rope: RoPE's (cos, sin) tables for the step's tokens."""
        x_in, row_norm = self.input_norm.projection_input(x)
        h, kv_pages = self.attn(x_in, rope, kv_pages, md, row_norm)
        x = x + h
        if isinstance(self.mlp, MoE):  # padding tokens must not route to experts
            live = jnp.arange(x.shape[0]) < md.cu_q_lens[md.num_seqs[0]]
            inv_rms = self.post_attn_norm.inv_rms(x)
            x_in = self.post_attn_norm.scaled(x, inv_rms)
            x = x + self.mlp(x_in, live, raw=(x, inv_rms))
        else:
            x_in, row_norm = self.post_attn_norm.projection_input(x)
            x = x + self.mlp(x_in, row_norm)
        return x, kv_pages


class Embedding(nnx.Module):
    """embedding [vocab, dim], its rows split over the vocabulary axis when sharded."""

    def __init__(self, vocab_size, dim, *, dtype, rngs: nnx.Rngs):
        self.embedding = new_param((vocab_size, dim), dtype, lambda: nnx.initializers.normal(
            0.02)(rngs.params(), (vocab_size, dim), dtype), axes=P("vocab", "embed"))

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
            shape = (config.vocab_size, config.hidden_size)
            self.lm_head = new_param(shape, dtype, lambda: nnx.initializers.normal(0.02)(
                rngs.params(), shape, dtype), axes=P("vocab", "embed"))

    def __call__(self, token_ids: jax.Array, positions: jax.Array, kv_cache: list,
                 md: AttentionMetadata):
        """token_ids, positions [T] int32 -> (hidden [T, hidden_size], updated kv_cache)."""
        x = self.embed(token_ids)
        # RoPE's tables, once for all layers (per layer they cost a kernel each at decode).
        rope = rope_tables(positions, *rope_inv_freq(self.config), x.dtype)
        if isinstance(self.layers, ScannedLayers):
            x, new_cache = self.layers(x, rope, kv_cache, md)
        else:
            new_cache = []
            for layer, kv_pages in zip(self.layers, kv_cache, strict=True):
                x, kv_pages = layer(x, rope, kv_pages, md)
                new_cache.append(kv_pages)
        return self.final_norm(x), new_cache

    @property
    def kv_cache_pools(self) -> tuple[int, int]:
        """(pools, layers per pool): the KV cache is a list of `pools` (k, v) page-array
        pairs; pool j holds the pages of `layers per pool` layers, each layer's num_pages
        pages after the one before (`ScannedLayers`). Unrolled layers: one pool a layer."""
        if isinstance(self.layers, ScannedLayers):
            return self.layers.period, self.layers.num_groups
        return len(self.layers), 1

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., hidden_size] -> float32 logits [..., vocab]."""
        w = self.embed.embedding[...] if self.lm_head is None else self.lm_head[...]
        return linear(hidden, w).astype(jnp.float32)


class ScannedLayers(nnx.Module):
    """The layers as one `jax.lax.scan` over `num_groups` groups of `period` consecutive
    layers alike in structure (`scan_layers`): a step traces and compiles one group, not
    every layer.

    `group` is one group (`period` DecoderLayers) whose parameters are stacked over the
    groups: each [num_groups, *the layer's shape], logical axes P(None, *the layer's). The
    KV cache is `period` pools (`Decoder.kv_cache_pools`): pool j holds the pages of layer j
    of every group, group g's at page offset g * (pages of one layer), which the group's
    attention metadata adds to its page tables; the pools go through the scan as its carry
    and the kernels write into them in place.
    """

    def __init__(self, group: nnx.List, num_groups: int):
        self.group = group
        self.num_groups = num_groups
        self.period = len(group)

    def __call__(self, x, rope, kv_cache: list, md: AttentionMetadata):
        graphdef, stacked = nnx.split(self.group)
        layer_pages = kv_cache[0][0].shape[0] // self.num_groups

        def body(carry, xs):
            x, pools = carry
            state, g = xs
            layers = nnx.merge(graphdef, jax.tree.map(
                lambda v: v.replace(axes=P(*v.get_metadata()["axes"][1:])), state,
                is_leaf=lambda v: isinstance(v, nnx.Variable)))
            md_g = dataclasses.replace(md, page_indices=md.page_indices + g * layer_pages)
            pools = list(pools)
            for j, layer in enumerate(layers):
                x, pools[j] = layer(x, rope, pools[j], md_g)
            return (x, pools), None

        (x, kv_cache), _ = jax.lax.scan(
            body, (x, list(kv_cache)), (stacked, jnp.arange(self.num_groups, dtype=jnp.int32)))
        return x, kv_cache


def scan_period(layers: list) -> int:
    """The smallest p dividing len(layers) such that layer i and layer i + p have the same
    structure and parameter shapes, dtypes and placements (gpt-oss, alternating sliding and
    full attention: 2); len(layers) when there is none."""
    signatures = []
    for layer in layers:
        graphdef, state = nnx.split(layer)
        signatures.append((graphdef, tuple((x.shape, x.dtype, x.sharding)
                                           for x in jax.tree.leaves(state))))
    n = len(layers)
    return next(p for p in range(1, n + 1)
                if n % p == 0 and all(signatures[i] == signatures[i + p] for i in range(n - p)))


def scan_layers(model: Decoder) -> bool:
    """Runs `model`'s layers as a scan (`ScannedLayers`) from now on, their parameters moved
    into stacked arrays (the layers' own arrays are freed one parameter at a time, so the
    move needs one stacked parameter of room). False, and the model unchanged, when no
    period shorter than the model repeats (nothing to share)."""
    layers = list(model.layers)
    period = scan_period(layers)
    num_groups = len(layers) // period
    if num_groups < 2:
        return False
    graphdef, _ = nnx.split(nnx.List(layers[:period]))
    states = [nnx.split(nnx.List(layers[g * period:(g + 1) * period]))[1]
              for g in range(num_groups)]

    def stack(*variables):
        values = [v[...] for v in variables]
        sharding = values[0].sharding
        if isinstance(sharding, jax.sharding.NamedSharding):
            sharding = jax.sharding.NamedSharding(sharding.mesh, P(None, *sharding.spec))
        if all(d.platform == "cpu" for d in sharding.device_set):
            # Host memory already: a NumPy stack skips a compile per parameter shape.
            stacked = jax.device_put(np.stack([np.asarray(x) for x in values]), sharding)
        else:
            stacked = jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)(*values)
        for value in values:
            value.delete()
        return variables[0].replace(stacked, axes=P(None, *variables[0].get_metadata()["axes"]))

    stacked = jax.tree.map(stack, *states, is_leaf=lambda v: isinstance(v, nnx.Variable))
    model.layers = ScannedLayers(nnx.merge(graphdef, stacked), num_groups)
    return True
