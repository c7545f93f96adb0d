"""Ragged paged attention: its implementations in preference order, and the entry point.

`ragged_paged_attention` (the contract's signature: `jaxinfer.ops.attention`, plus
`implementation=`) describes the call (`AttentionCall`), asks `REGISTRY.pick` for the first
implementation that supports it, runs the neighbouring work the implementation does not fuse
(splitting a fused q | k | v projection, the q / k prologue), and calls it.

  pallas_gpu   the Pallas kernel's GPU (Triton) lowering: Hopper, steps of up to
               PALLAS_GPU_MAX_TOKENS tokens (batch-1 decode); reads the fused projection in
               place and applies the prologue itself
  mosaic_gpu   the Mosaic GPU kernel: Hopper, any step; given the fused projection (pages
               in q's dtype or fp8), a Pallas GPU (Triton) kernel first writes the step's
               k / v into the pages and q ready for attention, the prologue applied
               (`pallas_kernels/kv_write_gpu.py`), where XLA took three kernels
  pallas_tpu   the Pallas TPU kernel: TPU
  by_sequence  XLA loops, one live sequence at a time (work: the batch's live tokens x their
               context): everything else (the CPU, other GPUs, float32 models)
  reference    the pure-JAX spec, dense over every sequence slot (T x S x context scores:
               tests and `implementation="reference"` only)
  mosaic_gpu_fixed  batch-invariant mode on Hopper: the Mosaic GPU kernel with one KV block
               size and no KV splits in every step (`batch_invariant_config`)
  by_sequence_fixed_rows  batch-invariant mode elsewhere: `by_sequence` with row blocks of
               one size in every program, so a token's products have one shape whatever
               its batch

The kernels' own `unsupported_reason` says what inputs a kernel can take (dtypes, head_dim,
page_size); the predicates here add the platform and the size rules. `implementation="name"`
forces one (tests, benchmarks); kernels then run in interpret mode off their hardware.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from jaxinfer.ops.attention import (
    AttentionCall,
    AttentionMetadata,
    ragged_paged_attention_reference,
    split_qkv,
)
from jaxinfer.ops.attention_by_sequence import ragged_paged_attention_by_sequence
from jaxinfer.ops.platform import needs
from jaxinfer.ops.registry import Implementation, KernelModule, Registry
from jaxinfer.ops.rope import QKPrologue

mosaic_gpu_kernel = KernelModule("jaxinfer.mosaic.ragged_paged_attention", "hopper")
pallas_tpu_kernel = KernelModule("jaxinfer.pallas_kernels.ragged_paged_attention", "tpu")
# jax's Pallas Triton lowering is deprecated in jax 0.11: a jax without it skips the entry.
pallas_gpu_kernel = KernelModule("jaxinfer.pallas_kernels.ragged_paged_attention_gpu", "hopper",
                                 requires="jax.experimental.pallas.triton")
kv_write_gpu_kernel = KernelModule("jaxinfer.pallas_kernels.kv_write_gpu", "hopper",
                                   requires="jax.experimental.pallas.triton")

# Steps of up to this many tokens use the Pallas GPU kernel on Hopper (bench/NOTES.md,
# Ragged paged attention: Pallas GPU kernel for one-token steps; measured at batch-1
# decode). Its program per (token, KV head, split) reaches its first K block sooner than
# the Mosaic kernel's CTAs, but reads a sequence's pages once per token, so larger steps
# keep the Mosaic kernel.
PALLAS_GPU_MAX_TOKENS = 1

# The neighbouring work an implementation may fuse: reading q, k and v out of the fused
# projection (`split_qkv`), and the steps of the prologue (`QKPrologue`): the row scale
# of q, k and v, then q's and k's norm and RoPE.
SPLIT_QKV, ROW_SCALE, QK_NORM, ROPE = "split_qkv", "row_scale", "qk_norm", "rope"


def _pallas_gpu_supports(call: AttentionCall) -> str | None:
    if (reason := needs("hopper")) is not None:
        return reason
    if call.num_tokens > PALLAS_GPU_MAX_TOKENS:
        return (f"{call.num_tokens} tokens: more than PALLAS_GPU_MAX_TOKENS "
                f"({PALLAS_GPU_MAX_TOKENS}), where the Mosaic kernel is faster")
    if (kernel := pallas_gpu_kernel.module()) is None:
        return "this jax has no Pallas Triton lowering"
    return kernel.unsupported_reason(call.query, call.pages)


def _pallas_gpu_fuses(call: AttentionCall) -> tuple[str, ...]:
    """The kernel reads a fused projection in place and applies the prologue itself where
    it can (one token, pages in q's dtype: `fuses_prologue`); elsewhere XLA does both."""
    kernel = pallas_gpu_kernel.module()
    if kernel is not None and kernel.fuses_prologue(call.query, call.pages):
        return (SPLIT_QKV, QK_NORM, ROPE)
    return ()


def _mosaic_gpu_supports(call: AttentionCall) -> str | None:
    return needs("hopper") or mosaic_gpu_kernel.unsupported_reason(call.query, call.pages)


def _mosaic_gpu_fuses(call: AttentionCall) -> tuple[str, ...]:
    """Given the fused projection, the k / v write kernel splits it, applies the whole
    prologue and writes the pages (in q's dtype or fp8: `kv_write_gpu.supports`)."""
    kernel = kv_write_gpu_kernel.module()
    if call.fused_qkv and kernel is not None and kernel.supports(call.query, call.pages):
        return (SPLIT_QKV, ROW_SCALE, QK_NORM, ROPE)
    return ()


def _pallas_gpu(*args, **kwargs):
    """`ragged_paged_attention_gpu`, or (a jax without the Triton lowering, where the entry
    supports no call) a one-line error when it is forced."""
    if (kernel := pallas_gpu_kernel.module()) is None:
        raise ValueError("pallas_gpu attention: this jax has no Pallas Triton lowering")
    return kernel.ragged_paged_attention_gpu(*args, **kwargs)


def _mosaic_gpu(q, k, v, k_pages, v_pages, md, *, k_scale=None, v_scale=None,
                prologue: QKPrologue | None = None, **kwargs):
    """The Mosaic kernel; with the fused projection (k = v = None: `_mosaic_gpu_fuses`),
    the k / v write kernel first, which also makes q (split out, prologue applied)."""
    if k is None:
        q, k_pages, v_pages = kv_write_gpu_kernel.module().write_kv_and_queries_gpu(
            q, k_pages, v_pages, md, prologue=prologue, k_scale=k_scale, v_scale=v_scale)
        out = mosaic_gpu_kernel.attend_pages_mgpu(q, k_pages, v_pages, md, k_scale=k_scale,
                                                  v_scale=v_scale, **kwargs)
        return out, k_pages, v_pages
    return mosaic_gpu_kernel.ragged_paged_attention_mgpu(
        q, k, v, k_pages, v_pages, md, k_scale=k_scale, v_scale=v_scale, **kwargs)


def _pallas_tpu(*args, **kwargs):
    return pallas_tpu_kernel.ragged_paged_attention_tpu(*args, **kwargs)


REGISTRY = Registry("ragged_paged_attention", [
    Implementation("pallas_gpu", _pallas_gpu, _pallas_gpu_supports,
                   fuses=_pallas_gpu_fuses),
    Implementation("mosaic_gpu", _mosaic_gpu, _mosaic_gpu_supports, fuses=_mosaic_gpu_fuses),
    Implementation("pallas_tpu", _pallas_tpu, lambda call: needs("tpu")),
    Implementation("by_sequence", ragged_paged_attention_by_sequence, lambda call: None),
    Implementation("reference", ragged_paged_attention_reference, lambda call: None),
    Implementation("mosaic_gpu_fixed", functools.partial(_mosaic_gpu, batch_invariant=True),
                   _mosaic_gpu_supports, batch_invariant=True),
    Implementation("by_sequence_fixed_rows",
                   functools.partial(ragged_paged_attention_by_sequence, fixed_rows=True),
                   lambda call: None, batch_invariant=True),
])


def ragged_paged_attention(
    q, k, v, k_pages, v_pages, md: AttentionMetadata, *,
    sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
    sinks: jax.Array | None = None, k_scale: float | None = None, v_scale: float | None = None,
    prologue: QKPrologue | None = None, implementation: str | None = None,
):
    """Writes k/v into the pages and attends (`jaxinfer.ops.attention` has the layouts):
    -> (out [T, Hq, D] in q.dtype, k_pages, v_pages).

    q [T, Hq, D] with k, v [T, Hkv, D], or q the fused projection [T, (Hq + 2 Hkv) * D] with
    k = v = None. `prologue`: q and k are the raw projections, normed and rotated first.
    `implementation` forces one of REGISTRY.names; None picks the first that supports the
    call. Where the implementation does not fuse them, the fused projection is split and the
    prologue applied here, with XLA.
    """
    call = AttentionCall.describe(q, k, k_pages, md, sliding_window=sliding_window,
                                  soft_cap=soft_cap, sinks=sinks, prologue=prologue)
    impl = REGISTRY.pick(call, implementation)
    fused = impl.fused(call)
    if prologue is not None and ROW_SCALE not in fused and prologue.row_norm is not None:
        if k is None:
            q, = prologue.scale_rows(q)  # the fused projection
        else:
            q, k, v = prologue.scale_rows(q, k, v)
        prologue = dataclasses.replace(prologue, row_norm=None)
    if k is None and SPLIT_QKV not in fused:
        q, k, v = split_qkv(q, call.num_kv_heads, call.head_dim)
    options = {}
    if QK_NORM in fused and ROPE in fused:
        options["prologue"] = prologue  # the implementation applies it
    elif prologue is not None:
        q, k = prologue.apply(q, k)
    return impl.fn(q, k, v, k_pages, v_pages, md, sm_scale=sm_scale,
                   sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks,
                   k_scale=k_scale, v_scale=v_scale, **options)
