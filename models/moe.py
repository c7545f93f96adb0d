"""The mixture-of-experts feed-forward block (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss).

Per layer, for T tokens x [T, H], E experts, top-k routing:
  1. route: router logits [T, E] (float32) -> the k experts of each token and their
     weights [T, k] (softmax over the chosen k, or the top-k of the full softmax);
  2. sort the T*k (token, expert) pairs by expert once (not at one token: its k experts
     differ, and each row is a group of its own; `jaxinfer.ops.expert_routing`); gather
     the rows x_rows [T*k, H] and count group_sizes [E];
  3. one `grouped_matmul` per projection over all experts: gate_up [E, 2I, H] (the gate
     rows, then the up rows) -> [T*k, 2I]; the activation (silu(gate) * up inside the
     gate_up call, `swiglu=True`); down [E, H, I] -> [T*k, H];
  4. each token sums its k rows times their router weights (a gather; at one token,
     without expert biases, the weights scale the down projection's input instead). Qwen2-MoE
     adds a shared expert scaled by sigmoid(gate(x)).

Checkpoint keys inside `layers.{i}.mlp`: router.weight [E, H] (+ router.bias),
experts.gate_up_proj.weight [E, 2I, H], experts.down_proj.weight [E, H, I] (+ .bias
[E, 2I] / [E, H] for gpt-oss; quantized stacks add weight_scale [E, K // g, N]),
shared_expert.{gate,up,down}_proj.weight, shared_expert_gate.weight [1, H]. As it runs,
the router is a `FoldedRouter` where it can be (its norm's scale in its weight) and the
shared expert's gate/up are one `ProjectionGroup` (`jaxinfer.models.inference_form`).
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.models.layers import MLP, Linear, abstract_module
from jaxinfer.ops.expert_routing import ExpertRows, expert_rows, top_k_experts
from jaxinfer.ops.grouped_matmul_registry import grouped_matmul
from jaxinfer.ops.linear import swiglu_halves
from jaxinfer.ops.registry import row_local
from jaxinfer.sharding import P, reduce_over, shard_index, shard_map_logical


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


def route(logits: jax.Array, k: int, norm_topk_prob: bool,
          logit_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E] float32 -> (weights [T, k] float32, experts [T, k] int32), the
    largest logit first; of equal logits the lower expert first, as `lax.top_k`.

    norm_topk_prob: the weights are a softmax over the k largest logits (equal to the full
    softmax's top k renormalised); else the full softmax's top-k entries as they are.
    logit_scale [T, 1] float32 > 0: the logits are `logits * logit_scale` (a router that
    holds its norm's scale: `FoldedRouter`); the top k are picked on the unscaled
    ones, which rank the same.

    The top k come from `top_k_experts` (at decode sizes from ranks, not a sort). The
    softmax over the k is elementwise (its sum written out as k - 1 adds): XLA runs it in
    one small kernel with the padding mask that follows (1.2 us at one token, where the
    softmax's reduction took 1.6 alone; bench/NOTES.md, MoE end to end: Norm folded into the
    router; softmax over the k as elementwise ops).
    """
    top_logits, experts = top_k_experts(logits, k)
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


class Router(Linear):
    """The router: weight [E, H] (+ bias [E]) scoring each expert from the normalised input."""

    def logits(self, x, raw=None):
        """x [T, H] (normalised), raw: unused (see `FoldedRouter`) -> (logits [T, E] float32,
        None: no per-token scale for `route`)."""
        return self(x).astype(jnp.float32), None


class FoldedRouter(Router):
    """A router without bias whose weight holds its norm's scale (`Linear.fold_scale`): it
    scores the input before the norm, and `route` scales its logits by 1 / rms. (A bias
    would not commute with the scale.) The norm itself stays: the experts read its output.

    Why: the normalised input then has one reader left, the gather of the experts' rows,
    and XLA computes it inside that gather: one kernel fewer per layer at decode.
    """

    @classmethod
    def of(cls, router: Router) -> FoldedRouter:
        """`router` (without bias, its weight holding the norm's scale) as a folded router."""
        w, axes = router.weight, router.axes
        folded = abstract_module(lambda: cls(w.shape[1], w.shape[0], axes=axes, bias=False,
                                             dtype=w.dtype, rngs=None))
        folded.weight = nnx.Param(w.get_value(), axes=axes)
        return folded

    def logits(self, x, raw=None):
        """raw: (the input before the norm [T, H], its inv_rms [T, 1] float32) -> (logits
        [T, E] float32 of the un-normalised input, inv_rms: their per-token scale)."""
        if raw is None:
            raise ValueError("FoldedRouter: the router holds the norm's scale; "
                             "pass raw=(x, inv_rms)")
        x_raw, inv_rms = raw
        return self(x_raw).astype(jnp.float32), inv_rms


class MoE(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        c = config
        # Every device scores every expert (the router is small), so its rows are not split.
        self.router = Router(c.hidden_size, c.num_experts, axes=P(None, "embed"),
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

    def __call__(self, x, live=None, raw=None):
        """x [T, H] (normalised), live [T] bool (None: all), raw: (the input before the
        norm [T, H], its inv_rms [T, 1] float32), read by a `FoldedRouter` -> [T, H].

        Padding tokens (not `live`) are routed nowhere: their pairs sort last, past every
        group, so they make no expert's weights read (a padded decode batch of one token
        still reads only its k experts); their outputs are meaningless.

        On a mesh every device routes all tokens, runs the rows of its own experts (ep) on
        its columns of their MLPs (tp), and one psum over both axes combines.
        """
        c = self.config
        logits, logit_scale = self.router.logits(x, raw)
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
    # The pairs as the grouped matmuls' rows (one token: in the router's order; else sorted
    # by expert, for prefill with each group on an 8-row boundary).
    order, pair_row, rows = expert_rows(local, num_local, T)
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
    # A dot over k, whose order XLA may pick by its shape (T): row local.
    h = token_rows.shape[-1]
    out = row_local(lambda wb, rb: jnp.einsum("tk,tkh->th", wb, rb.reshape(-1, k, h)),
                    weights, token_rows.reshape(T, k * h))
    return reduce_over(("experts", "mlp"), out)
