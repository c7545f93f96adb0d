"""The mixture-of-experts feed-forward block (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss).

Per layer, for T tokens x [T, H], E experts, top-k routing:
  1. route: router logits [T, E] (float32) -> the k experts of each token and their
     weights [T, k] (softmax over the chosen k, or the top-k of the full softmax);
  2. sort the T*k (token, expert) pairs by expert once (not at one token: its k experts
     differ, and each row is a group of its own); gather the rows x_rows [T*k, H] and
     count group_sizes [E];
  3. one `grouped_matmul` per projection over all experts: gate_up [E, 2I, H] (the gate
     rows, then the up rows) -> [T*k, 2I]; the activation (silu(gate) * up inside the
     gate_up call, `swiglu=True`); down [E, H, I] -> [T*k, H];
  4. each token sums its k rows times their router weights (a gather; at one token,
     without expert biases, the weights scale the down projection's input instead). Qwen2-MoE
     adds a shared expert scaled by sigmoid(gate(x)).

Checkpoint keys inside `layers.{i}.mlp`: router.weight [E, H] (+ router.bias),
experts.gate_up_proj.weight [E, 2I, H], experts.down_proj.weight [E, H, I] (+ .bias
[E, 2I] / [E, H] for gpt-oss; quantized stacks add weight_scale [E, K // g, N]),
shared_expert.{gate,up,down}_proj.weight, shared_expert_gate.weight [1, H].
"""

from __future__ import annotations

import functools
import operator
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.models.layers import MLP, Linear, RMSNorm
from jaxinfer.ops.grouped_matmul import GROUP_ALIGN, RowGroups, grouped_matmul, swiglu_halves
from jaxinfer.sharding import P, reduce_over, shard_index, shard_map_logical


class ExpertRows(NamedTuple):
    """The grouped matmuls' rows: group_sizes [L] int32, expert [M] int32 (each row's
    expert; L: none), groups, each row's group span (`RowGroups`) where the sort gave it
    (decode steps), else None, whether the rows are sorted by expert, and whether each
    group's size is a multiple of GROUP_ALIGN rows (`_align_groups`; both static)."""
    group_sizes: jax.Array
    expert: jax.Array
    groups: RowGroups | None
    sorted: bool = True
    aligned: bool = False


class ExpertLinear(Linear):
    """A stack of E linear layers: weight [E, out, in] (+ bias [E, out]), float or quantized
    (`Linear.set_quantized` with a stacked `QuantizedWeight`); `axes` names (out, in)."""

    def __init__(self, num_experts, in_features, out_features, *, axes: P, bias, dtype,
                 rngs: nnx.Rngs):
        super().__init__(in_features, out_features, axes=P("experts", *axes), bias=bias,
                         dtype=dtype, rngs=rngs, num_experts=num_experts)
        self.in_features = in_features

    def __call__(self, x_rows, rows: ExpertRows, swiglu: bool = False):
        """x_rows [M, in] (each row's expert as `rows` says) -> [M, out], or with
        swiglu (no bias) silu(gate) * up [M, out / 2] of the gate and up halves. On a mesh
        this runs per device on its shards (see `MoE`): when `in` is split the rows are
        partial sums, and only the first shard adds the bias."""
        w = self.quantized_weight() if self.quantized else self.weight[...]
        y = grouped_matmul(x_rows, w, rows.group_sizes, row_groups=rows.groups,
                           swiglu=swiglu, rows_sorted=rows.sorted,
                           groups_aligned=rows.aligned)
        if self.bias is not None:
            e = self.bias.shape[0]
            bias = self.bias[...][jnp.minimum(rows.expert, e - 1)].astype(jnp.float32)
            if x_rows.shape[1] != self.in_features:
                bias = jnp.where(shard_index(self.axes[-1]) == 0, bias, 0.0)
            y = (y.astype(jnp.float32) + bias).astype(x_rows.dtype)
        return y


# Up to this many compares (T x E x E) the top k come from ranks (see `route`).
RANK_TOP_K_MAX = 1 << 18


def route(logits: jax.Array, k: int, norm_topk_prob: bool,
          logit_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E] float32 -> (weights [T, k] float32, experts [T, k] int32), the
    largest logit first; of equal logits the lower expert first, as `lax.top_k`.

    norm_topk_prob: the weights are a softmax over the k largest logits (equal to the full
    softmax's top k renormalised); else the full softmax's top-k entries as they are.
    logit_scale [T, 1] float32 > 0: the logits are `logits * logit_scale` (a router that
    holds its norm's scale: `MoE.router_folded`); the top k are picked on the unscaled
    ones, which rank the same.

    Few tokens (decode): each expert's rank (how many experts come before it) as one
    compare-sum over [T, E, E], then the k first by rank as one more; XLA's top-k sorts
    each row, a kernel of ~3.5 us at one token, and these two take about 1 us each. The
    softmax over the k is elementwise (its sum written out as k - 1 adds): XLA runs it in
    one small kernel with the padding mask that follows (1.2 us at one token, where the
    softmax's reduction took 1.6 alone; bench/NOTES.md, MoE end to end v4).
    """
    T, E = logits.shape
    if T * E * E <= RANK_TOP_K_MAX:
        other, this = logits[:, None, :], logits[:, :, None]  # [T, e, e']
        ids = jnp.arange(E)
        before = (other > this) | ((other == this) & (ids[None, None, :] < ids[None, :, None]))
        rank = jnp.sum(before, axis=2, dtype=jnp.int32)  # [T, E]
        slot = rank[:, None, :] == jnp.arange(k)[None, :, None]  # [T, k, E]
        experts = jnp.sum(jnp.where(slot, ids, 0), axis=2, dtype=jnp.int32)
        top_logits = jnp.sum(jnp.where(slot, logits[:, None, :], 0.0), axis=2)
    else:
        top_logits, experts = jax.lax.top_k(logits, k)
    scale = 1.0 if logit_scale is None else logit_scale
    if norm_topk_prob:
        exps = jnp.exp((top_logits - top_logits[:, :1]) * scale)  # the first is the largest
        weights = exps / functools.reduce(operator.add, [exps[:, i:i + 1] for i in range(k)])
    else:
        scaled = logits * scale
        weights = jnp.exp(top_logits * scale - jax.nn.logsumexp(scaled, axis=-1, keepdims=True))
    return weights, experts.astype(jnp.int32)


class Experts(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        c = config
        e, i = c.num_experts, c.moe_intermediate_size
        self.gate_up_proj = ExpertLinear(e, c.hidden_size, 2 * i, axes=P("mlp", "embed"),
                                         bias=c.expert_bias, dtype=dtype, rngs=rngs)
        self.down_proj = ExpertLinear(e, i, c.hidden_size, axes=P("embed", "mlp"),
                                      bias=c.expert_bias, dtype=dtype, rngs=rngs)
        self.config = c

    def activation(self, gate_up):
        """[M, 2I] (gate | up, with the biases added) -> [M, I]."""
        c = self.config
        if c.activation != "gpt_oss":
            return swiglu_halves(gate_up, gate_up.dtype)
        gate, up = jnp.split(gate_up, 2, axis=-1)  # computed in the activation dtype, as HF
        gate = jnp.minimum(gate, c.swiglu_limit)
        up = jnp.clip(up, -c.swiglu_limit, c.swiglu_limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * c.swiglu_alpha))

    @property
    def fused_swiglu(self) -> bool:
        """Whether gate_up applies silu(gate) * up itself: SiLU and no biases."""
        return self.config.activation == "silu" and self.gate_up_proj.bias is None

    def __call__(self, x_rows, rows: ExpertRows, row_weights=None):
        """x_rows [M, H] -> [M, H]; row_weights [M] float32 (only with `fused_swiglu`)
        scale each row's down-projection input, so the rows come out weighted."""
        if self.fused_swiglu:
            # The grouped matmul applies silu(gate) * up itself (in its epilogue, on GPU);
            # with biases they must come first, so the activation runs after it.
            h = self.gate_up_proj(x_rows, rows, swiglu=True)
            if row_weights is not None:
                h = (h.astype(jnp.float32) * row_weights[:, None]).astype(h.dtype)
            return self.down_proj(h, rows)
        if row_weights is not None:
            raise ValueError("Experts: row_weights need the fused SiLU (no biases)")
        h = self.gate_up_proj(x_rows, rows)
        return self.down_proj(self.activation(h), rows)


class MoE(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        c = config
        # Every device scores every expert (the router is small), so its rows are not split.
        self.router = Linear(c.hidden_size, c.num_experts, axes=P(None, "embed"),
                             bias=c.router_bias, dtype=dtype, rngs=rngs)
        self.experts = Experts(c, dtype=dtype, rngs=rngs)
        if c.shared_expert_intermediate_size:
            self.shared_expert = MLP(c, intermediate_size=c.shared_expert_intermediate_size,
                                     dtype=dtype, rngs=rngs)
            self.shared_expert_gate = Linear(c.hidden_size, 1, axes=P(None, "embed"),
                                             bias=False, dtype=dtype, rngs=rngs)
        else:
            self.shared_expert = self.shared_expert_gate = None
        self.config = c
        self.router_folded = False  # static: see fold_norm_into_router

    def fold_norm_into_router(self, norm: RMSNorm):
        """Multiplies the norm's scale into the router's input columns, in place, when the
        router is float and has no bias; the block then routes the un-normalised input
        (`raw`), its logits scaled by 1 / rms in `route`. The runner calls it once.

        Why: the normalised input then has one reader left, the gather of the experts'
        rows, and XLA computes it inside that gather: one kernel fewer per layer at
        decode. (A router bias would not commute with the scale.)"""
        if self.router_folded or self.router.bias is not None:
            return
        self.router_folded = norm.fold_into([self.router], keep_norm=True)

    def __call__(self, x, live=None, raw=None):
        """x [T, H] (normalised), live [T] bool (None: all), raw: (the input before the
        norm [T, H], its inv_rms [T, 1] float32), needed once `router_folded` -> [T, H].

        Padding tokens (not `live`) are routed nowhere: their pairs sort last, past every
        group, so they make no expert's weights read (a padded decode batch of one token
        still reads only its k experts); their outputs are meaningless.

        On a mesh every device routes all tokens, runs the rows of its own experts (ep) on
        its columns of their MLPs (tp), and one psum over both axes combines.
        """
        c = self.config
        if self.router_folded:
            if raw is None:
                raise ValueError("MoE: the router holds the norm's scale "
                                 "(fold_norm_into_router); pass raw=(x, inv_rms)")
            x_raw, inv_rms = raw
            logits, logit_scale = self.router(x_raw).astype(jnp.float32), inv_rms
        else:
            logits, logit_scale = self.router(x).astype(jnp.float32), None
        weights, experts = route(logits, c.num_experts_per_tok, c.norm_topk_prob, logit_scale)
        if live is not None:
            experts = jnp.where(live[:, None], experts, c.num_experts)
        graphdef, state = nnx.split(self.experts)
        state_axes = jax.tree.map(lambda v: v.get_metadata()["axes"], state,
                                  is_leaf=lambda v: isinstance(v, nnx.Variable))

        def local(state, x, weights, experts):
            return _run_experts(nnx.merge(graphdef, state), x, weights, experts)

        tokens = P("batch", None)
        out = shard_map_logical(local, (state_axes, tokens, tokens, tokens), tokens,
                                state, x, weights, experts)
        if self.shared_expert is not None:
            gate = jax.nn.sigmoid(self.shared_expert_gate(x).astype(jnp.float32))
            out = out + gate * self.shared_expert(x).astype(jnp.float32)
        return out.astype(x.dtype)


def _run_experts(experts: Experts, x, weights, expert_ids):
    """This device's share of the MoE block: x [T, H], weights / expert_ids [T, k] (global
    ids; num_experts = routed nowhere) -> float32 [T, H], summed over the devices."""
    T, k = expert_ids.shape
    num_local = experts.gate_up_proj.weight.shape[0]
    # Pairs of other devices' experts, like padding, sort past every local group.
    local = expert_ids - shard_index("experts") * num_local
    valid = (local >= 0) & (local < num_local)
    local = jnp.where(valid, local, num_local).reshape(-1)
    # Counts as a compare-and-sum (fuses with its neighbours; a scatter-add would not).
    group_sizes = jnp.sum(local[:, None] == jnp.arange(num_local)[None, :], axis=0,
                          dtype=jnp.int32)
    aligned = False
    if T == 1:
        # One token (batch-1 decode): its k experts differ, so each pair is a group of one
        # row, and the rows stay in the router's order (the grouped matmul takes groups in
        # any order): the sort's two kernels a layer go.
        order = pair_row = jnp.arange(k, dtype=jnp.int32)
        row_local, row_groups, rows_sorted = local, RowGroups(local, order, order + 1), False
    else:
        order, row_local, pair_row, row_groups = _sort_pairs(local, num_local)
        rows_sorted = True
        if row_groups is None and aligns_groups(local.shape[0], num_local):
            # Many pairs (prefill): each group on an 8-row boundary.
            order, row_local, pair_row, group_sizes = _align_groups(pair_row, local,
                                                                    group_sizes)
            aligned = True
    rows = ExpertRows(group_sizes, row_local, row_groups, rows_sorted, aligned)
    weights = jnp.where(valid, weights, 0.0)  # pairs routed elsewhere carry weight 0
    if T == 1 and experts.fused_swiglu:
        # One token: its rows' router weights scale the down projection's input (in the
        # activation's kernel), so the combine is a plain sum that XLA fuses into the
        # residual add; weighting the outputs took a kernel of its own there.
        y_rows = experts(x[order // k], rows, weights.reshape(-1)[order])
        return reduce_over(("experts", "mlp"),
                           jnp.sum(y_rows[pair_row.reshape(T, k)].astype(jnp.float32), 1))
    y_rows = experts(x[order // k], rows)  # (an aligned layout's pad rows: never read)
    # Combine: each token sums its k rows times their router weights (a gather, which XLA
    # fuses into the residual add).
    token_rows = y_rows[pair_row.reshape(T, k)].astype(jnp.float32)  # [T, k, H]
    out = jnp.einsum("tk,tkh->th", weights, token_rows)
    return reduce_over(("experts", "mlp"), out)


# Up to this many pairs the sort is two compare-sums over [P, P] (see `_sort_pairs`).
RANK_SORT_MAX_PAIRS = 1024


def _sort_pairs(local: jax.Array, num_local: int):
    """Sorts the P (token, expert) pairs by expert, then pair: local [P] int32 (each pair's
    expert; num_local = routed nowhere, sorting last) -> (order [P]: the pair of each
    sorted row, sorted_local [P]: the expert of each row, pair_row [P]: the row of each
    pair, row_groups: each row's `RowGroups` span, or None).

    The keys expert * P + pair are unique, so the order is stable. Up to
    RANK_SORT_MAX_PAIRS pairs (decode steps) a pair's row is the number of keys below its
    own (and its group's span the number of experts below / not above its own), and each
    row's pair, expert and span are compare-sums against those rows: two kernels, where
    the sort, its key and index kernels, the scatter that inverted it and the grouped
    matmul's table were six. Beyond, one sort of the keys (an argsort would sort two
    operands, and XLA first copies the ids it sorts in place, a kernel of its own), and a
    scatter inverts it.
    """
    pairs = local.shape[0]
    ids = jnp.arange(pairs, dtype=jnp.int32)
    if (num_local + 1) * pairs >= 2 ** 31:  # the keys would not fit int32
        order = jnp.argsort(local, stable=True)
        sorted_local = local[order]
    elif pairs > RANK_SORT_MAX_PAIRS:
        keys = jnp.sort(local * pairs + ids)
        order, sorted_local = keys % pairs, keys // pairs
    else:
        keys = local * pairs + ids

        def count(below):  # [P, P] -> [P]: per row, how many columns hold
            return jnp.sum(below, axis=1, dtype=jnp.int32)
        pair_row = count(keys[None, :] < keys[:, None])
        start = count(local[None, :] < local[:, None])  # each pair's group span
        end = count(local[None, :] <= local[:, None])
        at_row = pair_row[None, :] == ids[:, None]  # [row, pair]
        order, sorted_local, row_start, row_end = (
            jnp.sum(jnp.where(at_row, v[None, :], 0), axis=1, dtype=jnp.int32)
            for v in (ids, local, start, end))
        return order, sorted_local, pair_row, RowGroups(sorted_local, row_start, row_end)
    pair_row = jnp.zeros((pairs,), jnp.int32).at[order].set(ids, unique_indices=True)
    return order, sorted_local, pair_row, None


# The aligned layout's static rows exceed the pairs by up to (GROUP_ALIGN - 1) per group;
# it is taken where that is at most a quarter of them (see `aligns_groups`).
ALIGN_MIN_PAIRS_PER_GROUP = 4 * (GROUP_ALIGN - 1)


def aligns_groups(pairs: int, num_local: int) -> bool:
    """Whether a step of `pairs` (token, expert) pairs over `num_local` experts sorts them
    into the aligned layout (`_align_groups`): beyond the rank sort's sizes, and with
    pairs >= ALIGN_MIN_PAIRS_PER_GROUP per expert, so that its static padding (up to 7 rows
    an expert, also gathered, activated and zeroed) stays under 25% of the rows. Qwen3-30B-
    A3B (128 experts, top-8): from 448 tokens; Mixtral (8, top-2): from 513 tokens."""
    return pairs > RANK_SORT_MAX_PAIRS and pairs >= ALIGN_MIN_PAIRS_PER_GROUP * num_local


def _align_groups(pair_row, local, group_sizes):
    """Spreads the sorted rows so that every group starts on a multiple of GROUP_ALIGN
    rows: each group's size is rounded up, and the pad rows after a group's own rows are
    computed like them and never read (vLLM pads its MoE groups to a block the same way).

    Why: the Mosaic grouped matmul then stores its output tiles in whole 8-row tiles
    through a swizzled shared buffer (`groups_aligned`): Qwen3-30B-A3B's down projection at
    4096 tokens went from 237 to 203 us (H200, bench/NOTES.md, grouped matmul v9). The
    layout costs at most GROUP_ALIGN - 1 rows a group (2.7% there) and no extra kernel:
    the row gathers only take other indices.

    pair_row [P] (each pair's row, sorted by expert), local [P] (each pair's expert; L:
    routed nowhere), group_sizes [L] -> (order [R]: each row's pair, row_local [R]: each
    row's expert, pair_row [P], group sizes [L]) of the aligned layout's
    R = P + (GROUP_ALIGN - 1) * min(L, P) rows (rounded up to GROUP_ALIGN). A pad row
    holds pair 0 and expert L; the rows routed nowhere stay last, past every group.
    """
    pairs, num_local = pair_row.shape[0], group_sizes.shape[0]
    padded = (group_sizes + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    # How far each group's rows move: the padded sizes before it minus the sizes before it
    # (group L, routed nowhere, moves by all the padding).
    shift = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(padded - group_sizes)])
    rows = -(-(pairs + (GROUP_ALIGN - 1) * min(num_local, pairs)) // GROUP_ALIGN) * GROUP_ALIGN
    pair_row = pair_row + shift[local]
    aligned_order = jnp.zeros((rows,), jnp.int32).at[pair_row].set(
        jnp.arange(pairs, dtype=jnp.int32), unique_indices=True)
    aligned_local = jnp.full((rows,), num_local, jnp.int32).at[pair_row].set(
        local, unique_indices=True)
    return aligned_order, aligned_local, pair_row, padded
