"""The grouped matmul over experts: its implementations in preference order, and the entry
point.

`grouped_matmul` (the contract's signature: `jaxinfer.ops.grouped_matmul`, plus
`implementation=`) describes the call (`GroupedMatmulCall`), asks `REGISTRY.pick` for the
first implementation that supports it, and runs it.

  row_reduce  XLA, each row against its own group's weights (`grouped_matmul_rows`):
              Hopper, calls that give `row_groups` (the MoE layer's decode steps), for up
              to ROW_REDUCE_MAX_M unsorted rows of float weights (one decode token's k
              rows), or up to min(E, QUANT_ROWS_MAX_M) rows of quantized formats the Mosaic
              kernel does not upcast itself (fp8, MXFP4, zero points, groups of 32)
  mosaic_gpu  the Mosaic GPU kernel: Hopper, bf16 / f16 rows, float or quantized experts
  pallas_tpu  the Pallas TPU kernel: TPU (rows out of group order are sorted first)
  reference   dequantise + `jax.lax.ragged_dot`: everything else
  rows_fixed_blocks  batch-invariant mode: `grouped_matmul_rows` over blocks of
              `invariant_rows()` rows (`by_row_blocks`), each row against its own group's
              weights, so a row's products do not depend on what else its group holds

The kernels' own `unsupported_reason` says what inputs a kernel can take, and the Mosaic
kernel's `upcasts_in_registers` which quantized formats it streams as stored; the predicates
here add the platform and the size rules. `implementation="name"` forces one (tests,
benchmarks): kernels then run in interpret mode off their hardware, and raise ValueError
for inputs they cannot take.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.ops.grouped_matmul import (
    ExpertWeights,
    GroupedMatmulCall,
    RowGroups,
    check_shapes,
    grouped_matmul_reference,
    grouped_matmul_rows,
    in_group_order,
)
from jaxinfer.ops.linear import swiglu_halves
from jaxinfer.ops.platform import needs
from jaxinfer.ops.registry import Implementation, KernelModule, Registry, by_row_blocks

mosaic_gpu_kernel = KernelModule("jaxinfer.mosaic.grouped_matmul", "hopper")
pallas_tpu_kernel = KernelModule("jaxinfer.pallas_kernels.grouped_matmul", "tpu")

# Up to this many unsorted rows (one decode token's k rows) of float weights, Hopper
# computes each row against its own group's weights as a gather, a multiply and a row
# reduction (`grouped_matmul_rows`), faster there than the Mosaic kernel (bench/NOTES.md,
# Grouped matmul (Mosaic GPU): One decode token's rows as XLA reductions).
ROW_REDUCE_MAX_M = 8
# Quantized weights the Mosaic kernel does not upcast itself (`upcasts_in_registers`) reduce
# by row on Hopper up to this many rows, and no more than the experts, sorted or not, when
# the caller gives `row_groups` (the MoE layer does at decode steps): below that, reading
# each row's expert as stored costs less than dequantising the whole stack.
QUANT_ROWS_MAX_M = 128


def _row_reduce_supports(call: GroupedMatmulCall) -> str | None:
    if (reason := needs("hopper")) is not None:
        return reason
    if not call.has_row_groups:
        return "no row_groups: the kernel walks the groups"
    m, e = call.rows, call.num_groups
    if not call.quantized:
        if call.rows_sorted:
            return "sorted rows of float weights: the kernel reads each group's weights once"
        if m > ROW_REDUCE_MAX_M:
            return (f"{m} rows of float weights: more than ROW_REDUCE_MAX_M "
                    f"({ROW_REDUCE_MAX_M}), where the kernel is faster")
        return None
    if mosaic_gpu_kernel.upcasts_in_registers(call.w, call.x.dtype):
        return (f"{call.w.kind} weights the Mosaic kernel upcasts in registers: faster "
                "there")
    if m > min(e, QUANT_ROWS_MAX_M):
        return (f"{m} rows: more than the {e} experts or QUANT_ROWS_MAX_M "
                f"({QUANT_ROWS_MAX_M}), where dequantising the stack costs less")
    return None


def _mosaic_gpu_supports(call: GroupedMatmulCall) -> str | None:
    return needs("hopper") or mosaic_gpu_kernel.unsupported_reason(call.x, call.w)


def _pallas_tpu_supports(call: GroupedMatmulCall) -> str | None:
    return needs("tpu") or pallas_tpu_kernel.unsupported_reason(call.x, call.w)


# Every implementation: fn(x, w, group_sizes, *, row_groups, swiglu, rows_sorted,
# groups_aligned) -> y, the contract's signature.

def _row_reduce(x, w, group_sizes, *, row_groups, swiglu, rows_sorted, groups_aligned):
    del group_sizes, rows_sorted, groups_aligned  # each row's group says it all
    if row_groups is None:
        raise ValueError("grouped_matmul row_reduce: needs row_groups")
    return grouped_matmul_rows(x, w, row_groups.group, swiglu=swiglu)


def _mosaic_gpu(x, w, group_sizes, *, row_groups, swiglu, rows_sorted, groups_aligned):
    return mosaic_gpu_kernel.grouped_matmul_mgpu(x, w, group_sizes, row_groups,
                                                 swiglu=swiglu, rows_sorted=rows_sorted,
                                                 groups_aligned=groups_aligned)


def _pallas_tpu(x, w, group_sizes, *, row_groups, swiglu, rows_sorted, groups_aligned):
    del groups_aligned

    def tpu(x):
        y = pallas_tpu_kernel.grouped_matmul_tpu(x, w, group_sizes)
        return swiglu_halves(y, x.dtype) if swiglu else y
    return in_group_order(tpu, x, None if rows_sorted else row_groups)


def _reference(x, w, group_sizes, *, row_groups, swiglu, rows_sorted, groups_aligned):
    del groups_aligned
    return in_group_order(lambda x: grouped_matmul_reference(x, w, group_sizes, swiglu=swiglu),
                          x, None if rows_sorted else row_groups)


def row_group_ids(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """Each of num_rows rows' group [M] int32 for rows sorted by group (group_sizes [E]):
    E for the rows past the last group."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    # Compared all at once, not the default while loop, whose condition a GPU reads back
    # to the host mid-step.
    return jnp.searchsorted(ends, jnp.arange(num_rows, dtype=jnp.int32), side="right",
                            method="compare_all").astype(jnp.int32)


def _rows_fixed_blocks(x, w, group_sizes, *, row_groups, swiglu, rows_sorted,
                       groups_aligned):
    del rows_sorted, groups_aligned  # each row's group says it all
    group = (row_group_ids(group_sizes, x.shape[0]) if row_groups is None
             else row_groups.group)
    return by_row_blocks(lambda xb, gb: grouped_matmul_rows(xb, w, gb[:, 0], swiglu=swiglu),
                         x, group[:, None])


REGISTRY = Registry("grouped_matmul", [
    Implementation("row_reduce", _row_reduce, _row_reduce_supports),
    Implementation("mosaic_gpu", _mosaic_gpu, _mosaic_gpu_supports),
    Implementation("pallas_tpu", _pallas_tpu, _pallas_tpu_supports),
    Implementation("reference", _reference, lambda call: None),
    Implementation("rows_fixed_blocks", _rows_fixed_blocks, lambda call: None,
                   batch_invariant=True),
])


def grouped_matmul(x: jax.Array, w: ExpertWeights, group_sizes: jax.Array, *,
                   row_groups: RowGroups | None = None, swiglu: bool = False,
                   rows_sorted: bool = True, groups_aligned: bool = False,
                   implementation: str | None = None) -> jax.Array:
    """x [M, K], w [E, N, K], group_sizes [E] -> [M, N], or [M, N / 2] with swiglu
    (`jaxinfer.ops.grouped_matmul` has the contract). `implementation` forces one of
    REGISTRY.names; None picks the first that supports the call."""
    check_shapes(x, w, group_sizes, swiglu)
    if not rows_sorted and row_groups is None:
        raise ValueError("grouped_matmul: rows_sorted=False needs row_groups")
    call = GroupedMatmulCall.describe(x, w, row_groups=row_groups, rows_sorted=rows_sorted,
                                      swiglu=swiglu, groups_aligned=groups_aligned)
    impl = REGISTRY.pick(call, implementation)
    return impl.fn(x, w, group_sizes, row_groups=row_groups, swiglu=swiglu,
                   rows_sorted=rows_sorted, groups_aligned=groups_aligned)
