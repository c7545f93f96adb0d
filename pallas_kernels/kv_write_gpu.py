"""This step's k / v into the pages, and attention's q, from the fused projection: a Pallas
kernel, GPU (Triton) lowering, one program per token.

    write_kv_and_queries_gpu(qkv, k_pages, v_pages, md, *, prologue=None, k_scale=None,
                             v_scale=None) -> (q [T, Hq, D], k_pages, v_pages)

  qkv        [T, (Hq + 2 Hkv) * D]  the fused projection as the model's product gave it
                                    (heads q | k | v), q.dtype bf16 or f16
  k_pages    [num_pages, page_size, Hkv, D] in qkv's dtype or float8_e4m3fn (an fp8 KV
             cache: k / k_scale clipped to e4m3, `quantize_kv`; v_pages alike), aliased
             to the outputs: updated in place under donation
  md         `AttentionMetadata`: token t goes to its sequence's page and slot
             (`token_slots`); padding tokens write nothing
  prologue   a `QKPrologue` or None: q, k and v times its row norm's 1 / rms (computed
             here from the sums of squares), then q's and k's norm and RoPE
             (`QKPrologue.scale_rows`, `QKPrologue.apply`), rounded where XLA's ops round

Program t loads token t's heads whole ([Hq, D], [Hkv, D] twice, each head count rounded up
to a power of two by repeating the last head, whose duplicate stores write the same values),
with a second load of q's and k's heads with their halves swapped (RoPE's rotate_half, as
the attention kernel's prologue does it), stores q in token order and k / v at the token's
page row as the pages' dtype holds them, non-finite values as 0 (`quantize_kv`: on fp8 pages
divided by the scale, clipped and rounded to e4m3). As XLA ops this took three kernels a
layer in the Mosaic attention's steps: q's RoPE and the two k / v scatters (bench/NOTES.md,
Ragged paged attention: One pass for the k / v write and q).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jaxinfer.ops.attention import (
    FP8_KV_DTYPE,
    AttentionMetadata,
    quantize_kv,
    token_slots,
    zero_page_tails,
)
from jaxinfer.ops.rope import QKPrologue
from jaxinfer.pallas_kernels.ragged_paged_attention_gpu import prologue_rows, swapped_d


def _kernel(slot_ref, *refs, num_q_heads: int, num_kv_heads: int,
            row_norm: tuple[int, float] | None, prologue: dict | None,
            k_scale: float | None, v_scale: float | None):
    """Token t = program 0. slot_ref [T]: the token's row of the pages viewed as
    [num_pages * page_size, Hkv, D], -1 for padding; then sum_sq_ref [T] float32 if
    row_norm (its (dim, eps): the row scale is rsqrt(sum_sq / dim + eps), `RowNorm`);
    cos_ref / sin_ref [T, D] and q_norm_ref / k_norm_ref [D] (if it has norms) if
    prologue; heads_ref [T, Hq + 2 Hkv, D]; the pages (aliased, not read). Outputs: q_ref
    [T, Hq, D], then the pages."""
    refs = list(refs)
    sum_sq_ref = refs.pop(0) if row_norm is not None else None
    cos_ref = sin_ref = None
    norm_refs = (None, None)
    if prologue is not None:
        cos_ref, sin_ref = refs.pop(0), refs.pop(0)
        if prologue["norm"]:
            norm_refs = (refs.pop(0), refs.pop(0))
    heads_ref, _, _, q_ref, k_out_ref, v_out_ref = refs
    t = pl.program_id(0)
    slot = slot_ref[t]
    dtype = heads_ref.dtype
    scaled = row_norm is not None
    if scaled:  # `RowNorm.inverse`
        dim, eps = row_norm
        scale = lax.rsqrt(sum_sq_ref[t] / dim + eps)

    def load(head0: int, count: int, rotate: bool, norm_ref):
        """Heads [head0, head0 + count) of token t, [count rounded up, D], prologue applied."""
        h = head0 + jnp.minimum(lax.iota(jnp.int32, pl.next_power_of_2(count)), count - 1)
        x = heads_ref[t, h, :]
        x_swap = pl_triton.load(heads_ref.at[t, h[:, None], swapped_d(x)[None, :]]) \
            if rotate else None
        if scaled:  # `QKPrologue.scale_rows`: float32, rounded to the projection's dtype
            x = (x.astype(jnp.float32) * scale).astype(dtype)
            x_swap = None if x_swap is None else (x_swap.astype(jnp.float32) * scale
                                                  ).astype(dtype)
        if rotate:
            x = prologue_rows(x, x_swap, norm_ref, cos_ref, sin_ref, t, prologue)
        return h - head0, x

    rotate = prologue is not None
    hq, q = load(0, num_q_heads, rotate, norm_refs[0])
    hk, k = load(num_q_heads, num_kv_heads, rotate, norm_refs[1])
    _, v = load(num_q_heads + num_kv_heads, num_kv_heads, False, None)
    q_ref[t, hq, :] = q
    # Every index an array: interpret mode's masked scatter wants that.
    d = lax.iota(jnp.int32, q.shape[-1])[None, :]
    row = jnp.full((hk.shape[0], 1), jnp.maximum(slot, 0), jnp.int32)
    keep = jnp.full(k.shape, slot >= 0)
    pl_triton.store(k_out_ref.at[row, hk[:, None], d],
                    quantize_kv(k, k_out_ref.dtype, k_scale), mask=keep)
    pl_triton.store(v_out_ref.at[row, hk[:, None], d],
                    quantize_kv(v, v_out_ref.dtype, v_scale), mask=keep)


def supports(q, k_pages) -> bool:
    """Whether the kernel takes queries q [T, Hq, D] (the fused projection's query heads)
    with these pages: q bf16 or f16, pages in q's dtype or fp8 (e4m3), D a power of two."""
    D = q.shape[-1]
    return (q.dtype in (jnp.bfloat16, jnp.float16)
            and k_pages.dtype in (q.dtype, FP8_KV_DTYPE) and D >= 16 and D & (D - 1) == 0)


@functools.partial(jax.jit, static_argnames=("k_scale", "v_scale"))
def write_kv_and_queries_gpu(qkv, k_pages, v_pages, md: AttentionMetadata, *,
                             prologue: QKPrologue | None = None, k_scale: float | None = None,
                             v_scale: float | None = None):
    """See the module docstring: -> (q [T, Hq, D], k_pages, v_pages)."""
    num_pages, page_size, Hkv, D = k_pages.shape
    T = qkv.shape[0]
    heads = qkv.reshape(T, -1, D)
    Hq = heads.shape[1] - 2 * Hkv
    if not supports(jax.ShapeDtypeStruct((T, Hq, D), qkv.dtype), k_pages):
        raise ValueError(f"kv write kernel: q {qkv.dtype} head_dim {D} with pages "
                         f"{k_pages.dtype}: q bf16 or f16, pages in q's dtype or e4m3, "
                         "head_dim a power of two >= 16 required")
    page, slot, valid = token_slots(md, T, page_size)
    slot = jnp.where(valid, page * page_size + slot, -1)  # its row of the flattened pages
    args = [slot]
    row_norm = None if prologue is None else prologue.row_norm
    if row_norm is not None:
        args.append(row_norm.sum_sq.reshape(T).astype(jnp.float32))
    if prologue is not None:
        args += [prologue.cos, prologue.sin]
        if prologue.q_norm is not None:
            args += [prologue.q_norm, prologue.k_norm]
    pages_shape = (num_pages * page_size, Hkv, D)
    n = len(args)
    args += [heads, k_pages.reshape(pages_shape), v_pages.reshape(pages_shape)]
    kernel = functools.partial(
        _kernel, num_q_heads=Hq, num_kv_heads=Hkv,
        row_norm=None if row_norm is None else (row_norm.dim, row_norm.eps),
        prologue=None if prologue is None else dict(norm=prologue.q_norm is not None,
                                                    eps=prologue.eps),
        k_scale=k_scale, v_scale=v_scale)
    q, k_out, v_out = pl.pallas_call(
        kernel, grid=(T,),
        out_shape=[jax.ShapeDtypeStruct((T, Hq, D), qkv.dtype),
                   jax.ShapeDtypeStruct(pages_shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(pages_shape, v_pages.dtype)],
        input_output_aliases={n + 1: 1, n + 2: 2},
        compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=1),
        interpret=jax.default_backend() != "gpu",
    )(*args)
    k_pages, v_pages = k_out.reshape(k_pages.shape), v_out.reshape(v_pages.shape)
    if md.zero_tails:  # (not in the runner's steps: `AttentionMetadata.zero_tails`)
        k_pages, v_pages = zero_page_tails(k_pages, v_pages, md)
    return q, k_pages, v_pages
