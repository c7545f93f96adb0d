"""Quantized matmuls on the GPU, side by side in one run: ours, XLA and jax's stock kernel.

  python bench/quantized_matmul_kernels.py [--quick] [--shapes square,llama] [--ms 1,16,64,...]
                                   [--formats int8,int4,...] [--iters N] [--max-minutes T]
                                   [--force-kernel]
                                   [--out FILE.md] [--json FILE] [--cpu-smoke]

y = x @ W^T with x [M, K] bf16 and W [N, K] (out_features, in_features). One markdown
table per weight shape, one row per (M, format):

  floor       max(weight bytes / copy bandwidth, 2MNK / bf16 matmul rate), both ceilings
              measured in the same run (`jaxinfer.benchmarks.harness.measure_ceilings`);
              weight bytes are
              `QuantizedWeight.nbytes` (values + float32 scales), 2NK for bf16. "bw" or
              "flop" says which bound it is. W8A8 (fp8) may beat the flop floor (fp8 tensor
              cores run at twice the bf16 rate).
  XLA         bf16 row: the XLA bf16 dot (`jaxinfer.ops.linear_registry.linear`); other rows:
              XLA with fused dequantisation of that format (`linear(implementation=
              "reference")`; for fp8 W8A8 it includes the per-token activation quantization).
  stock       int8 rows: jax's Hopper `hopper_mixed_type_matmul_mgpu.mixed_matmul_kernel`
              with the operands swapped (a = W int8 [N, K], b = x^T [K, Mp] bf16, x padded to
              Mp rows, shown as "M->Mp"); the kernel alone, the padding and transposes of x
              and y are left out, and it has no scales. The first TuningConfig of a short list
              that compiles and agrees with XLA is timed.
  ours        `linear(x, w)` as the engine dispatches it on Hopper: the Mosaic
              kernel for int8 / int4 (per channel or group 128) / mxfp4 / nvfp4 up to 16
              tokens, above that the XLA reference (fused dequant); fp8 W8A8 and
              weight-only run XLA's fp8 dot / fused dequant. `--force-kernel`: the Mosaic
              kernel wherever it takes the inputs, "n/a" elsewhere. Before timing, its
              output is checked against the XLA reference on the same inputs
              (max |ours - ref| <= 2e-2 max |ref| weight-only, 1e-1 W8A8): "FAIL" if not.
  % floor     floor / time (for M <= 16 the floor is the bandwidth one).
  vs bf16 / vs XLA / vs stock: speed-ups of ours (their time / ours) over the XLA bf16
              dot, XLA with the same format, and the stock kernel.

Times are CUPTI kernel-time medians (`jaxinfer.benchmarks.harness.median_seconds`; host
wall time on the CPU). Each timed function reads its weight from one of several copies in
turn (`harness.Rotating`, `harness.copies`), enough copies to exceed the L2 cache several
times over, so that back-to-back calls read the weight from HBM as a real decode step
would (a decode step streams every layer's weights).
Each function is jitted once; weights are quantized on the device once per shape; inputs
are fresh random normals per (shape, M). A cell that cannot run prints "n/a (reason)".
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time

import jax
import jax.numpy as jnp

from jaxinfer.benchmarks.harness import (
    ROTATE_BYTES,
    Cell,
    Rotating,
    copies,
    disagreement,
    measure_ceilings,
    median_seconds,
    short,
    timed_cell,
)
from jaxinfer.mosaic.quantized_matmul import unsupported_reason
from jaxinfer.ops.linear_registry import linear
from jaxinfer.ops.quant import parse_format, quantize

SHAPES = {  # (name, N, K)
    "square": [("square", 8192, 8192)],
    # Llama-3-8B: hidden 4096, 32 x 128 query heads, 8 KV heads, intermediate 14336.
    "llama": [("llama3-8b qkv fused", 6144, 4096), ("llama3-8b q / o", 4096, 4096),
              ("llama3-8b k / v", 1024, 4096), ("llama3-8b gate / up", 14336, 4096),
              ("llama3-8b down", 4096, 14336)],
    "smoke": [("cpu smoke", 256, 256)],
}
MS = (1, 16, 64, 128, 1024, 4096)
FORMATS = ("int8", "int4", "int8:g128", "int4:g128", "fp8", "fp8:g128", "fp8:weight-only",
           "mxfp4", "nvfp4")


# --- jax's stock Hopper int8 x bf16 kernel -----------------------------------------------------

def stock_candidates(m: int) -> list:
    """[(padded M, TuningConfig)], best guess first, for the stock kernel with the weight as
    its LHS (kernel m = N) and the padded activations as its RHS (kernel n = Mp).

    Small M: the two warpgroups split the weight rows (wg_dimension M, 128 rows a CTA) and the
    batch tile is the smallest that holds M. Large M: 128 x 256 CTA tiles (wg_dimension N).
    """
    from jax.experimental.pallas.ops.gpu.hopper_mixed_type_matmul_mgpu import (
        MatmulDimension,
        TuningConfig,
    )

    if m <= 128:
        return [(tn, TuningConfig(tile_m=64, tile_n=tn, tile_k=128,
                                  max_concurrent_steps=4 if tn <= 64 else 3,
                                  epi_tile_m=64, epi_tile_n=min(64, tn),
                                  wg_dimension=MatmulDimension.M))
                for tn in (16, 32, 64, 128) if tn >= m][:3]
    mp = -(-m // 256) * 256
    return [(mp, TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4,
                              grid_minor_dim=MatmulDimension.N, grid_tile_width=4,
                              wg_dimension=MatmulDimension.N)),
            (mp, TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=3))]


@functools.cache
def stock_fn(config):
    from jax.experimental.pallas.ops.gpu.hopper_mixed_type_matmul_mgpu import (
        mixed_matmul_kernel,
    )

    return jax.jit(functools.partial(mixed_matmul_kernel, out_dtype=jnp.bfloat16, config=config))


def cfg_label(cfg) -> str:
    return (f"tm{cfg.tile_m} tn{cfg.tile_n} tk{cfg.tile_k} s{cfg.max_concurrent_steps} "
            f"wg{cfg.wg_dimension}")


def time_stock(x, w_copies, bench) -> Cell:
    """The stock kernel on (W int8 [N, K], x^T padded to [K, Mp]): the fastest of the configs
    tried that compile and agree with XLA's x @ values^T (no scales) on the same inputs."""
    if jax.default_backend() != "gpu":
        return Cell(note="n/a (Hopper GPU only)")
    m = x.shape[0]
    want = _dot_values(x, w_copies[0][0])
    failures = []
    for mp, cfg in stock_candidates(m):
        xt = jnp.pad(x, ((0, mp - m), (0, 0))).T  # [K, Mp], materialised outside the timing
        fn = stock_fn(cfg)
        try:
            got = fn(w_copies[0][0], xt)[:, :m].T
            if (why := disagreement(got, want, 2e-2)) is not None:
                failures.append(f"FAIL {why}")
                continue
            t = bench(Rotating(fn, [(w, xt) for w, in w_copies]))
        except Exception as e:  # noqa: BLE001  (any lowering / compile / SMEM error)
            failures.append(short(e, 200))
            print(f"    stock {cfg_label(cfg)}: {failures[-1]}", flush=True)
            continue
        print(f"    stock {cfg_label(cfg)}: {t * 1e6:.1f} us", flush=True)
        return Cell(t, f"M->{mp}" if mp != m else "")
    reason = failures[0] if failures else "no config fits"
    kind = "FAIL" if reason.startswith("FAIL") else "n/a"
    return Cell(note=f"{kind} ({short(reason.removeprefix('FAIL '), 60)})")


@jax.jit
def _dot_values(x, values):
    """x @ values^T in XLA (what the stock kernel computes, without scales)."""
    return linear(x, values)


# --- the table ---------------------------------------------------------------------------------

def ratio(num: Cell | None, den: Cell | None) -> str:
    if num is None or den is None or num.seconds is None or den.seconds is None:
        return "-"
    r = num.seconds / den.seconds
    return f"{r:.2f}x" if r >= 0.1 else f"{r:.2g}x"


def pct(floor_s: float, cell: Cell | None) -> str:
    if cell is None or cell.seconds is None:
        return "-"
    p = 100 * floor_s / cell.seconds
    return f"{p:.0f}%" if p >= 1 else f"{p:.2g}%"


def table(title: str, rows: list[dict]) -> str:
    out = [f"### {title}", "",
           "| M | format | weight MB | floor (us) | XLA (us) | XLA % floor | stock (us) "
           "| ours (us) | ours % floor | vs bf16 | vs XLA | vs stock |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        out.append(
            f"| {r['m']} | {r['format']} | {r['weight_bytes'] / 1e6:.3g} | "
            f"{r['floor_s'] * 1e6:.1f} ({r['floor_kind']}) | {r['xla'].text()} | "
            f"{pct(r['floor_s'], r['xla'])} | {r['stock'].text() if r['stock'] else '-'} | "
            f"{r['ours'].text() if r['ours'] else '-'} | {pct(r['floor_s'], r['ours'])} | "
            f"{ratio(r['bf16'], r['ours'])} | "
            f"{ratio(r['xla'], r['ours']) if r['format'] != 'bf16' else '-'} | "
            f"{ratio(r['stock'], r['ours'])} |")
    return "\n".join(out)


def make_row(shape, n, k, m, nbytes, flop_floor, c, fmt, xla, stock=None, ours=None) -> dict:
    bw_floor = nbytes[fmt] / c.copy_bytes_per_s
    return {"shape": shape, "n": n, "k": k, "m": m, "format": fmt,
            "weight_bytes": nbytes[fmt], "floor_s": max(bw_floor, flop_floor),
            "floor_kind": "bw" if bw_floor >= flop_floor else "flop",
            "xla": xla, "stock": stock, "ours": ours}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="square shape, M in {1, 16, 4096}")
    ap.add_argument("--shapes", help="comma list of: square, llama (default both)")
    ap.add_argument("--ms", help="comma list of M (default 1,16,64,128,1024,4096)")
    ap.add_argument("--formats", help=f"comma list of {', '.join(FORMATS)} (default all)")
    ap.add_argument("--no-ours", action="store_true", help="skip the Mosaic GPU column")
    ap.add_argument("--force-kernel", action="store_true",
                    help="ours: the Mosaic kernel wherever it takes the inputs, even where "
                         "the engine would not pick it (above 16 tokens)")
    ap.add_argument("--no-stock", action="store_true", help="skip jax's stock kernel")
    ap.add_argument("--iters", type=int, help="timed calls per cell (default 10; smoke 3)")
    ap.add_argument("--max-minutes", type=float, default=7.0,
                    help="skip the cells left after this long (default 7)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="N = K = 256, M in {1, 16}: a quick check that runs on the CPU")
    ap.add_argument("--out", help="also write the tables (markdown) here")
    ap.add_argument("--json", help="also write every cell (seconds, notes) here")
    a = ap.parse_args()

    shapes = "smoke" if a.cpu_smoke else "square" if a.quick else "square,llama"
    ms = "1,16" if a.cpu_smoke else "1,16,4096" if a.quick else ",".join(map(str, MS))
    shapes = [s for name in (a.shapes or shapes).split(",") for s in SHAPES[name.strip()]]
    ms = [int(m) for m in (a.ms or ms).split(",")]
    formats = [f.strip() for f in a.formats.split(",")] if a.formats else list(FORMATS)
    for f in formats:
        parse_format(f)
    iters = a.iters or (3 if a.cpu_smoke else 10)
    bench = functools.partial(median_seconds, iters=iters, warmup=1 if a.cpu_smoke else 2)
    start = time.perf_counter()
    deadline = start + 60 * a.max_minutes

    device = jax.devices()[0]
    c = measure_ceilings()
    header = [f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}",
              c.line(), f"median of {iters} calls per cell; weights cycled over copies "
              f"of >= {ROTATE_BYTES >> 20} MB in all (cold L2)"]
    if jax.default_backend() != "gpu":
        header.append("not a GPU: host wall times; ours runs in Mosaic GPU interpret mode")
    print("\n".join(header), flush=True)

    ref = jax.jit(functools.partial(linear, implementation="reference"))
    # On the GPU: the engine's own dispatch (the Mosaic kernel where it applies, else its
    # XLA path); on the CPU the kernel itself, in interpret mode.
    gpu = jax.default_backend() == "gpu"
    ours = jax.jit(functools.partial(
        linear, implementation=None if gpu and not a.force_kernel else "mosaic_gpu"))
    bf16 = jax.jit(linear)
    quantize_on_device = jax.jit(quantize, static_argnums=1)
    tables, records = [], []

    def timed(label, fn, arg_sets) -> Cell:
        return timed_cell(label, bench, fn, arg_sets, deadline)

    def time_ours(label, x, w_copies) -> Cell:
        """Ours on (x, w), checked against the XLA reference on the same inputs, then timed."""
        if time.perf_counter() > deadline:
            return Cell(note="skipped (time budget)")
        w = w_copies[0][1]
        tol = 1e-1 if w.activations == "fp8" else 2e-2  # W8A8 : weight-only
        try:
            why = unsupported_reason(x, w)
            if why is not None and (not gpu or a.force_kernel):
                print(f"    {label}: unsupported: {why}", flush=True)
                return Cell(note=f"n/a ({short(why, 60)})")
            got, want = ours(x, w), ref(x, w)
        except Exception as e:  # noqa: BLE001
            print(f"    {label}: {short(e, 300)}", flush=True)
            return Cell(note=f"n/a ({short(e, 60)})")
        if (why := disagreement(got, want, tol)) is not None:
            print(f"    {label}: FAIL {why}", flush=True)
            return Cell(note=f"FAIL ({why})")
        return timed(label, ours, w_copies)

    key = jax.random.key(0)
    for si, (name, n, k) in enumerate(shapes):
        title = f"{name}: N={n} K={k}"
        print(f"{title} (at {time.perf_counter() - start:.0f} s)", flush=True)
        wkey = jax.random.fold_in(key, si)
        w = jax.random.normal(wkey, (n, k), jnp.float32) * 0.02
        weights = {"bf16": w.astype(jnp.bfloat16)}
        for f in formats:
            weights[f] = quantize_on_device(w, f)
        del w
        nbytes = {f: (2 * n * k if f == "bf16" else q.nbytes) for f, q in weights.items()}
        rot = {f: copies(q, nbytes[f]) for f, q in weights.items()}
        rows = []
        for m in ms:
            x = jax.random.normal(jax.random.fold_in(wkey, m), (m, k), jnp.bfloat16)
            flop_floor = 2 * m * n * k / c.matmul_flops_per_s
            row = functools.partial(make_row, name, n, k, m, nbytes, flop_floor, c)
            t_bf16 = timed(f"M={m} xla bf16", bf16, [(x, wc) for wc in rot["bf16"]])
            shape_rows = [row("bf16", t_bf16)]
            for f in formats:
                w_copies = [(x, wc) for wc in rot[f]]
                t_xla = timed(f"M={m} xla {f}", ref, w_copies)
                stock = None
                if f == "int8" and not a.no_stock:
                    stock = (Cell(note="skipped (time budget)")
                             if time.perf_counter() > deadline else
                             time_stock(x, [(wc.values,) for wc in rot[f]], bench))
                ours_cell = None
                if not a.no_ours:
                    ours_cell = time_ours(f"M={m} ours {f}", x, w_copies)
                shape_rows.append(row(f, t_xla, stock, ours_cell))
            for r in shape_rows:
                r["bf16"] = t_bf16
            rows += shape_rows
        del weights, rot
        tables.append(table(title, rows))
        print("\n" + tables[-1] + "\n", flush=True)
        records += rows
        # Rewritten after every shape, so that a run cut off keeps what it measured.
        if a.out:
            with open(a.out, "w") as fh:
                fh.write("\n".join(header) + "\n\n" + "\n\n".join(tables) + "\n")
        if a.json:
            with open(a.json, "w") as fh:
                json.dump({"device": device.device_kind, "ceilings": c.__dict__,
                           "rows": [{k: dataclasses.asdict(v) if isinstance(v, Cell) else v
                                     for k, v in r.items()} for r in records]}, fh, indent=1)
    print(f"done in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
