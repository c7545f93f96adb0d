"""Ragged paged attention on the GPU, side by side in one run: our kernels, jax's stock
paged_attention, the XLA reference and cuDNN.

  python bench/attention_kernels.py [--quick] [--tune] [--decode-sweep] [--json FILE]
  python bench/attention_kernels.py --batch1-sweep [--kv-heads 4] [--contexts 576]
      [--batches 1,4,16]

Rows: our Mosaic GPU kernel (`attend_pages_mgpu`: the query tiling, the kernel
and the split combine; the k/v write is left out because outside a benchmark the
pages are donated and the write is an in-place scatter of T rows, while here
XLA would copy the whole cache first), jax's stock Pallas
(Triton) `paged_attention` (decode only), the XLA reference, and the ceilings
measured in the same run: device copy bandwidth and the bf16 matmul rate. The
mixed step is also compared with cuDNN (`jax.nn.dot_product_attention`) on the
equivalent dense problem. `--batch1-sweep` times small decode batches (one token per
sequence): the Mosaic kernel, our Pallas GPU (Triton) kernel (`attend_pages_gpu`, its
default and other block sizes / split counts) and jax's stock paged_attention. Times are
CUPTI kernel-time medians (`jaxinfer.benchmarks.harness.median_seconds`); the batch-1
sweep also prints each kernel's share (`harness.kernel_times`). Inputs:
`jaxinfer.benchmarks.kernels.paged_attention_case` (32 query heads, 8 KV heads of 128,
16-token pages unless a flag says otherwise).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.benchmarks.harness import (
    format_rows,
    kernel_times,
    measure_ceilings,
    median_seconds,
    roofline,
)
from jaxinfer.benchmarks.kernels import attention_over_pages, paged_attention_case
from jaxinfer.mosaic.ragged_paged_attention import Config, attend_pages_mgpu, choose_config
from jaxinfer.ops.attention_registry import ragged_paged_attention
from jaxinfer.pallas_kernels.ragged_paged_attention_gpu import attend_pages_gpu

HQ, HKV, D, PAGE = 32, 8, 128, 16  # paged_attention_case's defaults


def ours(config=None, **kw):
    """The Mosaic GPU kernel over the pages; k/v are not written."""
    return attention_over_pages(attend_pages_mgpu, config=config, **kw)


def pallas_gpu(**kw):
    """The Pallas GPU (Triton) kernel over the pages; k/v are not written (its no-write
    branch: one load per block, where the engine's call also gathers this step's rows
    from k/v)."""
    return attention_over_pages(attend_pages_gpu, **kw)


def full(implementation, **kw):
    """The whole interface (write k/v, then attend); the cache is not donated."""
    return jax.jit(lambda *a: ragged_paged_attention(
        *a, sm_scale=D ** -0.5, implementation=implementation, **kw)[0])


def reference():
    return full("reference")


def stock_paged_attention(args):
    """jax.experimental.pallas.ops.gpu.paged_attention on the same decode batch (its own
    [Hkv, pages, page_size, D] layout, transposed once outside the timing)."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    q, _, _, kp, vp, md = args
    kp_t, vp_t = kp.transpose(2, 0, 1, 3), vp.transpose(2, 0, 1, 3)
    fn = jax.jit(lambda q, kp, vp, bt, lens: paged_attention(q * D ** -0.5, kp, vp, bt, lens))
    # Its pages per sequence must split into its 16 KV splits, a power of two pages each
    # (Triton's lowering); padding pages lie past every kv_len.
    per_split = -(-md.page_indices.shape[1] // 16)
    width = 16 * (1 << (per_split - 1).bit_length())
    bt = jnp.pad(md.page_indices, ((0, 0), (0, width - md.page_indices.shape[1])))
    return fn, (q, kp_t, vp_t, bt, md.kv_lens)


def kernel_breakdown(fn, args, iters=11):
    """Prints each kernel's median time (us) of one call of fn (CUPTI)."""
    _, per_kernel = kernel_times(fn, [args], iters=iters)
    parts = [f"{n[:40]} {t * 1e6:.2f}" for n, t in per_kernel]
    print("    kernels: " + ", ".join(parts), flush=True)


def check(fn, ref_fn, args, name):
    got = np.asarray(fn(*args).astype(jnp.float32))
    want = np.asarray(ref_fn(*args).astype(jnp.float32))
    err = float(np.abs(got - want).max())
    print(f"  check {name}: max |ours - reference| = {err:.3g}", flush=True)
    assert err < 5e-2, (name, err)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tune", action="store_true", help="also time a few kernel configs")
    ap.add_argument("--decode-sweep", action="store_true",
                    help="only the batch-64 decode shapes of the serving benchmark, over "
                    "the ring's block size and depth (and jax's stock kernel)")
    ap.add_argument("--page-sizes", default=str(PAGE),
                    help="--decode-sweep: tokens per KV page, a comma-separated list")
    ap.add_argument("--batch1-sweep", action="store_true",
                    help="only batch-1 decode (the latency benchmark's shape) over KV splits "
                    "and block sizes")
    ap.add_argument("--kv-heads", type=int, default=HKV,
                    help=f"--batch1-sweep: KV heads (of {HQ} query heads; Qwen3-30B-A3B: 4)")
    ap.add_argument("--contexts", default="512,1024,1600",
                    help="--batch1-sweep: KV lengths, a comma-separated list")
    ap.add_argument("--batches", default="1",
                    help="--batch1-sweep: decode batch sizes (one token per sequence)")
    ap.add_argument("--json")
    a = ap.parse_args()
    c = measure_ceilings()
    print(c.line(), flush=True)
    rows, extra = [], {}

    def add(name, fn, args, kv_bytes, flops):
        t = median_seconds(fn, *args)
        rows.append(roofline(name, t, kv_bytes, flops, c))
        print(f"  {name}: {t * 1e6:.1f} us", flush=True)
        return t

    if a.decode_sweep:
        rng = np.random.default_rng(0)
        shapes = [("B=256 ctx=384", [(1, 384)] * 256),
                  ("B=256 ctx U[128,512]", [(1, int(n)) for n in rng.integers(128, 513, 256)]),
                  ("B=64 ctx=896", [(1, 896)] * 64), ("B=64 ctx=1376", [(1, 1376)] * 64),
                  ("B=64 ctx U[640,1280]", [(1, int(n)) for n in rng.integers(640, 1281, 64)])]
        # (block_kv, num_stages) with decode's tile_rows 8 and no KV split
        configs = [(128, 2), (128, 3), (64, 3), (64, 4), (64, 6)]
        for (label, seqs), page in itertools.product(shapes, map(int, a.page_sizes.split(","))):
            args, nbytes, flops = paged_attention_case(seqs, page_size=page)
            label = f"{label} page={page}"
            check(full("mosaic_gpu"), reference(), args, label)
            add(f"{label} mosaic default", ours(), args, nbytes, flops)
            for bk, st in configs:
                if bk % page == 0:
                    cfg = Config(bk, st, 1, 1, 8, queries_in_place=True)
                    add(f"{label} mosaic bk={bk} stages={st}", ours(cfg), args, nbytes, flops)
            if page == PAGE:
                fn, sargs = stock_paged_attention(args)
                add(f"{label} stock paged_attention", fn, sargs, nbytes, flops)
        print(format_rows(rows))
        return

    if a.batch1_sweep:
        for ctx, bsz in itertools.product(map(int, a.contexts.split(",")),
                                          map(int, a.batches.split(","))):
            # page_indices as wide as the engine makes it (a power of two of pages)
            width = 1 << (-(-ctx // PAGE) - 1).bit_length()
            args, nbytes, flops = paged_attention_case(
                [(1, ctx)] * bsz, num_kv_heads=a.kv_heads, width=width)
            label = f"B={bsz} Hkv={a.kv_heads} ctx={ctx}"
            check(full("mosaic_gpu"), reference(), args, label)
            check(full("pallas_gpu"), reference(), args, label + " pallas_gpu")
            add(f"{label} mosaic default", ours(), args, nbytes, flops)
            kernel_breakdown(ours(), args)
            add(f"{label} pallas_gpu default", pallas_gpu(), args, nbytes, flops)
            kernel_breakdown(pallas_gpu(), args)
            for bk, splits in [(16, 1), (32, 1), (64, 1), (128, 1), (32, 4), (64, 2),
                               (64, 4), (64, 8), (32, 16)]:
                if splits * bk <= ctx + bk:
                    add(f"{label} pallas_gpu bk={bk} splits={splits}",
                        pallas_gpu(block_kv=bk, num_splits=splits), args, nbytes, flops)
            fn, sargs = stock_paged_attention(args)
            add(f"{label} stock paged_attention", fn, sargs, nbytes, flops)
        print(format_rows(rows))
        return

    decodes = [("decode B=64 ctx=2048", [(1, 2048)] * 64),
               ("decode B=8 ctx=32768", [(1, 32768)] * 8)]
    for label, seqs in decodes[:1] if a.quick else decodes:
        args, nbytes, flops = paged_attention_case(seqs)
        check(full("mosaic_gpu"), reference(), args, label)
        t_ours = add(f"{label} mosaic", ours(), args, nbytes, flops)
        fn, sargs = stock_paged_attention(args)
        t_stock = add(f"{label} stock paged_attention", fn, sargs, nbytes, flops)
        extra[f"{label} speedup vs stock"] = t_stock / t_ours
        if not a.quick:  # (includes XLA's copy of the undonated cache for the k/v write)
            add(f"{label} xla reference", reference(), args, nbytes, flops)
        if a.tune:
            for cfg in [Config(128, 2, 1, 1), Config(128, 3, 1, 1), Config(64, 4, 1, 1),
                        Config(128, 3, 1, 2), Config(128, 3, 1, 4), Config(128, 3, 1, 8),
                        Config(64, 6, 1, 4), Config(128, 2, 2, 1)]:
                add(f"{label} mosaic {cfg}", ours(cfg), args, nbytes, flops)

    # fp8 KV vs bf16 at context 8192.
    seqs = [(1, 8192)] * 32
    args16, b16, fl = paged_attention_case(seqs)
    args8, b8, _ = paged_attention_case(seqs, kv_dtype=jnp.float8_e4m3fn)
    check(full("mosaic_gpu", k_scale=1.0, v_scale=1.0),
          full("reference", k_scale=1.0, v_scale=1.0),
          paged_attention_case([(1, 1024)] * 4, kv_dtype=jnp.float8_e4m3fn)[0], "fp8 small")
    t16 = add("decode B=32 ctx=8192 bf16 KV mosaic", ours(), args16, b16, fl)
    t8 = add("decode B=32 ctx=8192 fp8 KV mosaic", ours(k_scale=1.0, v_scale=1.0), args8, b8, fl)
    extra["fp8 speedup vs bf16 (ctx 8192)"] = t16 / t8
    # The upcast warpgroup (Config.fp8_upcaster, the default) against each consumer
    # upcasting its own blocks, here and at the throughput run's decode step.
    b256_16, b256_b16, b256_fl = paged_attention_case([(1, 384)] * 256)
    b256_8, b256_b8, _ = paged_attention_case([(1, 384)] * 256, kv_dtype=jnp.float8_e4m3fn)
    t16_256 = add("decode B=256 ctx=384 bf16 KV mosaic", ours(), b256_16, b256_b16, b256_fl)
    for label, cargs, cbytes, cflops, t_bf16, (T, ctx) in (
            ("decode B=32 ctx=8192", args8, b8, fl, t16, (32, 8192)),
            ("decode B=256 ctx=384", b256_8, b256_b8, b256_fl, t16_256, (256, 384))):
        cfg = choose_config(T, T, HKV, ctx, D, HQ // HKV, fp8=True)
        for upcaster in (True, False):
            t = add(f"{label} fp8 KV mosaic upcaster={upcaster}",
                    ours(dataclasses.replace(cfg, fp8_upcaster=upcaster), k_scale=1.0,
                         v_scale=1.0), cargs, cbytes, cflops)
            extra[f"{label} fp8 upcaster={upcaster} vs bf16"] = t_bf16 / t
    if a.tune:  # smaller rings and two CTAs an SM (if they fit): more consumers to upcast
        for cfg in [Config(64, 3, 1, 1, 8), Config(64, 3, 1, 1, 8, 264),
                    Config(64, 2, 1, 1, 8, 264), Config(128, 2, 1, 1, 8, 264)]:
            add(f"decode B=32 ctx=8192 fp8 KV mosaic {cfg}", ours(cfg, k_scale=1.0, v_scale=1.0),
                args8, b8, fl)
            add(f"decode B=256 ctx=384 fp8 KV mosaic {cfg}",
                ours(cfg, k_scale=1.0, v_scale=1.0), b256_8, b256_b8, b256_fl)
            add(f"decode B=256 ctx=384 bf16 KV mosaic {cfg}", ours(cfg), b256_16, b256_b16,
                b256_fl)

    # Mixed step: 2048 new tokens of one sequence over an 8192 context, plus 64 decodes.
    seqs = [(2048, 8192)] + [(1, 2048)] * 64
    args, nbytes, flops = paged_attention_case(seqs)
    t_mixed = add("mixed 2048 prefill over 8192 + 64 decodes mosaic", ours(), args, nbytes, flops)
    # The two consumer warpgroups' ping-pong (Config.pingpong) against none, on this step and
    # on the throughput run's prefill step (7 prompts of 256 beside 240 decodes at ctx 384)
    # and on whole prompts.
    prefill_cfg = choose_config(4096, 256, HKV, 8192, D, HQ // HKV)
    thr_seqs = [(256, 256)] * 7 + [(1, 384)] * 240
    thr_args, thr_bytes, thr_flops = paged_attention_case(thr_seqs)
    check(full("mosaic_gpu"), reference(), thr_args, "throughput prefill step")
    cases = [("mixed 2048 over 8192 + 64 decodes", (args, nbytes, flops)),
             ("7 prompts of 256 + 240 decodes at ctx 384", (thr_args, thr_bytes, thr_flops)),
             ("4 prompts of 2048", paged_attention_case([(2048, 2048)] * 4))]
    for label, (cargs, cbytes, cflops) in cases:
        for pingpong in (True, False):
            cfg = dataclasses.replace(prefill_cfg, pingpong=pingpong)
            t = add(f"{label} mosaic pingpong={pingpong}", ours(cfg), cargs, cbytes, cflops)
            extra[f"{label}: pingpong={pingpong} us"] = t * 1e6
    if a.tune:
        for cfg in [Config(128, 2, 2, 1), Config(64, 3, 2, 1), Config(128, 3, 2, 1)]:
            add(f"mixed mosaic {cfg}", ours(cfg), args, nbytes, flops)
    # cuDNN on the equivalent dense problem: the 2048 queries against the 6144 cached keys
    # (no mask) plus the causal 2048 x 2048 block.
    ks = jax.random.split(jax.random.key(1), 3)
    qd = jax.random.normal(ks[0], (1, 2048, HQ, D), jnp.bfloat16)
    kd = jax.random.normal(ks[1], (1, 6144, HKV, D), jnp.bfloat16)
    vd = jax.random.normal(ks[2], (1, 6144, HKV, D), jnp.bfloat16)
    cudnn = functools.partial(jax.nn.dot_product_attention, implementation="cudnn")
    t_full = median_seconds(jax.jit(cudnn), qd, kd, vd)
    kc, vc = kd[:, :2048], vd[:, :2048]
    t_causal = median_seconds(jax.jit(functools.partial(cudnn, is_causal=True)), qd, kc, vc)
    prefill_flops = 4 * HQ * D * (2048 * 6144 + 2048 * 2049 // 2)
    rows.append(roofline("mixed-equivalent dense prefill cudnn (6144 full + 2048 causal)",
                         t_full + t_causal, 2 * 8192 * HKV * D * 2, prefill_flops, c))
    extra["mixed: ours / cudnn time"] = t_mixed / (t_full + t_causal)

    print(format_rows(rows))
    for k, v in extra.items():
        print(f"{k}: {v:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"ceilings": c.__dict__, "rows": rows, "ratios": extra}, f, indent=1)


if __name__ == "__main__":
    main()
