"""Grouped matmul over experts: the contract every caller and every implementation shares.

    grouped_matmul(x, w, group_sizes, *, row_groups=None, rows_sorted=True,
                   groups_aligned=False, swiglu=False) -> y = x @ W[e]^T for each row's expert e

  x            [M, K]     bfloat16 / float16 / float32 rows, sorted by expert: rows
                          [start_e, start_e + group_sizes[e]) belong to expert e, where
                          start_e = group_sizes[0] + ... + group_sizes[e - 1]
  w            [E, N, K]  float expert weights (K-major, like `jaxinfer.ops.linear`), or a
                          stacked `QuantizedWeight` (values [E, N, K], scales [E, K // g, N])
  group_sizes  [E]        int32, >= 0, summing to at most M (dynamic: shapes stay static)
  row_groups   RowGroups  optional: each row's group and a span of that group's rows
                          around it, which an MoE layer knows from its sort; a kernel that
                          walks rows then need not derive them from group_sizes
  rows_sorted  bool       False: the rows are not in group order (then row_groups is
                          required; see `RowGroups`)
  groups_aligned bool     a promise that every group size is a multiple of GROUP_ALIGN (8),
                          so every group starts on an 8-row boundary (the MoE layer's
                          prefill layout, `jaxinfer.ops.expert_routing`): the Mosaic kernel then
                          stores whole 8-row tiles through a swizzled buffer (~15% faster
                          at 4096 tokens; bench/NOTES.md, Grouped matmul (Mosaic GPU):
                          Whole 8-row output tiles at prefill); others ignore it
  swiglu       bool       w holds each expert's gate rows, then its up rows (N = 2 N'):
                          y = silu(x W_gate^T) * (x W_up^T) [M, N'], from the float32
                          products (the Mosaic kernel does it in its epilogue at decode
                          sizes, saving the activation's own kernel; elsewhere it runs
                          after the matmul)
  -> y         [M, N]     in x.dtype, accumulated in float32; rows at or past
                          sum(group_sizes) are zero

The MoE layer (`jaxinfer.models.moe`) lays its (token, expert) pairs out as rows once per
layer (`jaxinfer.ops.expert_routing`) and makes one call per projection over all experts.
Callers use `jaxinfer.ops.grouped_matmul_registry.grouped_matmul`, which picks an
implementation for the call (`GroupedMatmulCall`) and runs it; this module holds what they
share: the row metadata (`RowGroups`, `GROUP_ALIGN`), the shape checks, the pure-JAX
reference (`grouped_matmul_reference`, the spec the kernels are tested against), the
row-by-row form (`grouped_matmul_rows`), and the helpers for rows out of group order
(`in_group_order`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxinfer.ops.linear import swiglu_halves
from jaxinfer.ops.quant import QuantizedWeight, dequantize

ExpertWeights = jax.Array | QuantizedWeight

GROUP_ALIGN = 8  # rows: see `groups_aligned`


class RowGroups(NamedTuple):
    """For each of the M rows, [M] int32 each: its group (E: a row of no group, whose
    output is zero), and the span [start, end) of rows of that group it belongs to.

    Spans are what the Mosaic kernel computes together (one read of the group's weights
    per span). Usually each group is one span and the rows are sorted by group; with
    `grouped_matmul(..., rows_sorted=False)` a group may have several spans, in any order
    (one decode token's k rows, each its own span, in the router's order:
    `jaxinfer.ops.expert_routing`), and implementations that read the rows in group order
    get them sorted first."""
    group: jax.Array
    start: jax.Array
    end: jax.Array


def grouped_matmul_reference(x: jax.Array, w: ExpertWeights, group_sizes: jax.Array, *,
                             swiglu: bool = False) -> jax.Array:
    """The spec: dequantise the stack, then `jax.lax.ragged_dot` (XLA; dense on GPU)."""
    w = dequantize(w, x.dtype) if isinstance(w, QuantizedWeight) else w.astype(x.dtype)
    y = jax.lax.ragged_dot_general(
        x, w, group_sizes.astype(jnp.int32),
        jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(((1,), (2,)), ((), ())),
            lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]),
        preferred_element_type=jnp.float32)
    return swiglu_halves(y, x.dtype) if swiglu else y.astype(x.dtype)


def grouped_matmul_rows(x: jax.Array, w: ExpertWeights, group: jax.Array, *,
                        swiglu: bool = False) -> jax.Array:
    """x [M, K], w [E, N, K] (float or quantized), group [M] int32 (E: no group) -> y
    [M, N] (or [M, N / 2] with swiglu) in x.dtype: y[m] = x[m] @ w[group[m]]^T, 0 for rows
    of no group, accumulated in float32, whatever order the rows are in.

    XLA runs it as one reduction kernel that gathers each row's weights (and x's rows)
    itself, like `linear`'s one-row form; every row reads its group's whole matrix, so it
    suits a few rows of distinct groups: one decode token's k experts (bench/NOTES.md,
    Grouped matmul (Mosaic GPU): One decode token's rows as XLA reductions). Quantized rows
    are dequantised inside that kernel, as the reference does (to x's dtype), so they are
    read in their stored width: any format."""
    e = w.shape[0]
    idx = jnp.minimum(group, e - 1)
    if isinstance(w, QuantizedWeight):
        w_rows = dequantize(QuantizedWeight(
            w.values[idx], w.scales[idx], None if w.offsets is None else w.offsets[idx],
            k_order=w.k_order),
            x.dtype)
    else:
        w_rows = w[idx].astype(x.dtype)
    w_rows = w_rows.astype(jnp.float32)  # [M, N, K]
    y = jnp.sum(x.astype(jnp.float32)[:, None, :] * w_rows, axis=-1)
    y = jnp.where((group < e)[:, None], y, 0.0)
    return swiglu_halves(y, x.dtype) if swiglu else y.astype(x.dtype)


def check_shapes(x, w: ExpertWeights, group_sizes, swiglu: bool = False):
    """Raises ValueError unless x [M, K], w [E, N, K] and group_sizes [E] agree (and, with
    swiglu, N holds two halves)."""
    if x.ndim != 2 or len(w.shape) != 3:
        raise ValueError(f"grouped_matmul: x {tuple(x.shape)} must be [M, K] and w "
                         f"{tuple(w.shape)} [E, N, K]")
    e, _, k = w.shape
    if x.shape[1] != k:
        raise ValueError(f"grouped_matmul: x has {x.shape[1]} features, the weights {k}")
    if tuple(group_sizes.shape) != (e,):
        raise ValueError(f"grouped_matmul: group_sizes {tuple(group_sizes.shape)}, "
                         f"expected ({e},)")
    if swiglu and w.shape[1] % 2:
        raise ValueError(f"grouped_matmul: swiglu needs gate and up halves, N={w.shape[1]} "
                         "is odd")


class GroupedMatmulCall(NamedTuple):
    """What the implementations' `supports` predicates read (shapes and dtypes only): x
    [M, K], the weights [E, N, K] (float, or a stacked `QuantizedWeight`; a call may be
    described with `jax.ShapeDtypeStruct`s in place of arrays), and the call's options."""
    x: jax.ShapeDtypeStruct
    w: ExpertWeights
    has_row_groups: bool = False
    rows_sorted: bool = True
    swiglu: bool = False
    groups_aligned: bool = False

    @classmethod
    def describe(cls, x, w: ExpertWeights, *, row_groups: RowGroups | None = None,
                 rows_sorted: bool = True, swiglu: bool = False,
                 groups_aligned: bool = False) -> GroupedMatmulCall:
        """The call grouped_matmul(x, w, ..., row_groups=..., ...) makes."""
        return cls(jax.ShapeDtypeStruct(x.shape, x.dtype), w, row_groups is not None,
                   rows_sorted, swiglu, groups_aligned)

    @property
    def rows(self) -> int:
        return self.x.shape[0]

    @property
    def num_groups(self) -> int:
        return self.w.shape[0]

    @property
    def quantized(self) -> bool:
        return isinstance(self.w, QuantizedWeight)


def in_group_order(fn, x: jax.Array, row_groups: RowGroups | None) -> jax.Array:
    """fn(x's rows sorted by group) with its rows put back in x's order; fn(x) when
    row_groups is None (the rows are in group order already)."""
    if row_groups is None:
        return fn(x)
    order = jnp.argsort(row_groups.group, stable=True)  # rows of no group (E) last
    y = fn(x[order])
    return jnp.zeros_like(y).at[order].set(y, unique_indices=True)
