"""The Mosaic quantized matmul's configurations side by side on the GPU, one table per
(shape, format, M): the default (`choose_config`) and its neighbours in consumer warpgroups,
pieces a step, K splits, MMA form and (mma.sync) two CTAs an SM, each checked against the
XLA reference first. Shape sets: llama and decode (gate_up: one of the two halves), model
(the Llama-3-8B projections as the model calls them, gate and up as one).

  python bench/quantized_matmul_sweep.py [--shapes decode] [--formats int4:g128,mxfp4]
      [--ms 1,16] [--wgs 1,2] [--mma wgmma,sync,words32] [--splits 1,2,4]
      [--share-sm 0,1] [--max-minutes T] [--out FILE.md]

Columns: config (wgmma, mma.sync or words32: 4-bit codes as 32-bit words under mma.sync;
wgs consumers, pps pieces a step, st ring stages, ks K splits, "shared SM":
`Config.share_sm`), kernel time (CUPTI median over weights cycled past the L2, as
bench/quantized_matmul_kernels.py), % of the bytes floor (weight bytes as stored at the
copy rate measured in this run) and the ratio to the default. "FAIL" where the output
disagrees with the reference (2e-2 of max |ref|).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp

from jaxinfer.benchmarks.harness import (
    Rotating,
    copies,
    disagreement,
    measure_ceilings,
    median_seconds,
    short,
)
from jaxinfer.mosaic import quantized_matmul as qmm
from jaxinfer.ops.linear_registry import linear
from jaxinfer.ops.quant import quantize

SHAPES = {  # (name, N, K)
    "llama": [("llama3-8b qkv", 6144, 4096), ("llama3-8b o", 4096, 4096),
              ("llama3-8b gate_up", 14336, 4096), ("llama3-8b down", 4096, 14336)],
    "decode": [("llama3-8b qkv", 6144, 4096), ("llama3-8b gate_up", 14336, 4096),
               ("llama3-8b down", 4096, 14336)],
    # as the model calls them (gate and up as one projection)
    "model": [("llama3-8b qkv", 6144, 4096), ("llama3-8b o", 4096, 4096),
              ("llama3-8b gate_up (fused)", 28672, 4096), ("llama3-8b down", 4096, 14336)],
    "square": [("square", 8192, 8192)],
    "smoke": [("cpu smoke", 256, 512)],
}


MMA_FORMS = {"wgmma": dict(mma_sync=False, words32=False),
             "sync": dict(mma_sync=True, words32=False),
             "words32": dict(mma_sync=True, words32=True)}  # int4 and fp4


def neighbours(default: qmm.Config, total_pieces: int, wgs_list, forms,
               splits_list=None, share_sm=(False,)) -> list[qmm.Config]:
    """The default, then configs that tile the same K with other consumer counts, pieces a
    step, K splits (`splits_list`, or the default's and twice it) and MMA forms
    (`MMA_FORMS`; a config the kernel does not take, or that does not fit the shared
    memory, is reported as n/a)."""
    out = [default]
    for form in forms:
        for wgs in wgs_list:
            for pps in sorted({wgs, 2 * wgs, 4 * wgs, 8 * wgs}):
                for splits in splits_list or sorted({default.k_splits, default.k_splits * 2}):
                    if total_pieces % (pps * splits) or total_pieces // (pps * splits) < 2:
                        continue
                    for share in share_sm:
                        if share and form == "wgmma":
                            continue
                        cfg = dataclasses.replace(default, compute_wgs=wgs,
                                                  pieces_per_step=pps, k_splits=splits,
                                                  share_sm=share, **MMA_FORMS[form])
                        if cfg not in out:
                            out.append(cfg)
    return out


def label(cfg: qmm.Config) -> str:
    form = "words32" if cfg.words32 else "mma.sync" if cfg.mma_sync else "wgmma"
    return (f"{form} wgs {cfg.compute_wgs} pps "
            f"{cfg.pieces_per_step} st {cfg.num_stages} ks {cfg.k_splits}"
            f"{' shared SM' if cfg.share_sm else ''}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="llama")
    ap.add_argument("--formats", default="int4:g128,mxfp4")
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--wgs", default="1,2", help="consumer warpgroup counts to try")
    ap.add_argument("--mma", default="wgmma,sync",
                    help=f"MMA forms to try: {', '.join(MMA_FORMS)}")
    ap.add_argument("--splits", help="K splits to try (default: the default's and twice it)")
    ap.add_argument("--share-sm", default="0",
                    help="mma.sync register hand-over off (1), on (0), or both (0,1)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--max-minutes", type=float, default=6.0)
    ap.add_argument("--top", type=int, default=6, help="rows a table keeps (fastest first)")
    ap.add_argument("--out")
    a = ap.parse_args()
    gpu = jax.default_backend() == "gpu"
    bench = functools.partial(median_seconds, iters=a.iters if gpu else 2,
                              warmup=2 if gpu else 1)
    deadline = time.perf_counter() + 60 * a.max_minutes
    c = measure_ceilings()
    lines = [f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", c.line(), ""]
    print("\n".join(lines), flush=True)
    ref = jax.jit(functools.partial(linear, implementation="reference"))
    key = jax.random.key(0)
    for name, n, k in (s for group in a.shapes.split(",") for s in SHAPES[group]):
        w_float = jax.random.normal(key, (n, k), jnp.bfloat16) * 0.05
        for fmt in a.formats.split(","):
            w = jax.jit(quantize, static_argnums=1)(w_float, fmt)
            w_copies = copies((w,), w.nbytes)
            piece = qmm.piece_size(w)
            for m in (int(s) for s in a.ms.split(",")):
                x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.bfloat16)
                want = ref(x, w)
                default = qmm.default_config(x, w)
                rows = []
                for cfg in neighbours(default, k // piece,
                                      [int(v) for v in a.wgs.split(",")],
                                      a.mma.split(","),
                                      a.splits and [int(v) for v in a.splits.split(",")],
                                      [bool(int(v)) for v in a.share_sm.split(",")]):
                    if time.perf_counter() > deadline:
                        break
                    fn = jax.jit(functools.partial(qmm.quantized_matmul_mgpu, config=cfg))
                    try:
                        err = disagreement(fn(x, w), want, 2e-2)
                        t = bench(Rotating(fn, [(x, wc) for wc, in w_copies]))
                    except Exception as e:  # noqa: BLE001  (SMEM, lowering)
                        print(f"  {label(cfg)}: n/a ({short(e, 120)})", flush=True)
                        continue
                    rows.append((t, cfg, err))
                    print(f"  {name} {fmt} M={m} {label(cfg)}: {t * 1e6:.1f} us"
                          f"{' FAIL: ' + err if err else ''}", flush=True)
                if not rows:
                    continue
                floor = w.nbytes / c.copy_bytes_per_s
                base = next((t for t, cfg, _ in rows if cfg == default), None)
                table = [f"### {name} N={n} K={k}, {fmt}, M={m}", "",
                         "| config | us | % floor | vs default | check |",
                         "| --- | --- | --- | --- | --- |"]
                for t, cfg, err in sorted(rows, key=lambda r: r[0])[:a.top]:
                    mark = " (default)" if cfg == default else ""
                    table.append(f"| {label(cfg)}{mark} | {t * 1e6:.1f} | {floor / t:.0%} | "
                                 f"{base / t if base else float('nan'):.2f}x | "
                                 f"{'FAIL' if err else 'ok'} |")
                lines += table + [""]
                print("\n".join(table), flush=True)
                if a.out:
                    with open(a.out, "w") as f:
                        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
