"""MoE expert grouped matmuls on the GPU: ours against XLA and jax's Mosaic GPU ragged dot.

  python bench/grouped_matmul_kernels.py [--quick] [--models qwen3,mixtral,gpt-oss]
      [--proj gate_up,down] [--tokens 1,8,64,512,4096] [--draws N] [--iters N] [--sweep]
      [--xla-max-seconds S] [--max-minutes T] [--quantize FMT [--words32]]
      [--out FILE.md] [--cpu-smoke]

y = x @ W[e]^T per row's expert e, x [tokens * top_k, hidden] bf16 sorted by expert,
W [E, N, K] bf16 (`jaxinfer.ops.grouped_matmul`). Expert shapes:
  qwen3-30b-a3b  E=128, top-8, hidden 2048, expert intermediate 768:
                 gate_up [128, 1536, 2048] (gate and up fused), down [128, 2048, 768]
  mixtral-8x7b   E=8, top-2, hidden 4096, intermediate 14336:
                 gate_up [8, 28672, 4096], down [8, 4096, 14336]
  gpt-oss-20b    E=32, top-4, hidden 2880, intermediate 2880:
                 gate_up [32, 5760, 2880], down [32, 2880, 2880]
--quantize int8 (or int4, int8:g128, ...): the expert weights quantized (`jaxinfer.ops.quant`);
the floor then counts their stored bytes (values and scales), the reference dequantises
the stack and runs ragged_dot, and ragged_dot_mgpu (bf16 only) gets the dequantised bf16
stack: the bf16 kernel one would run instead. Formats the kernel does not upcast itself
(fp8, zero points, ...) it takes dequantised whole first. The log also times
`grouped_matmul_rows` where it is the default at decode (float rows up to
`ROW_REDUCE_MAX_M`, rows of those formats up to min(E, `QUANT_ROWS_MAX_M`)), and at one
token for int8 / int4 experts, for comparison.
Routing is drawn at random: each token picks top_k distinct experts uniformly. Each cell
cycles over `--draws` routings (so back-to-back calls mostly hit other experts, as the
layers of a decode step would: weights come from HBM, not L2).

Columns:
  rows         tokens * top_k; hit: experts with at least one row (mean over the draws)
  floor        max(bytes of the experts hit / copy bandwidth, 2 * rows * N * K / bf16
               matmul rate), both ceilings measured in this run (`measure_ceilings`)
  ours         `grouped_matmul(..., implementation="mosaic_gpu")` (jitted), checked first
               against the XLA reference on the same inputs: "err" is max |ours - ref| /
               max |ref| (FAIL above 2e-2). Where `aligns_groups` (Qwen3 at 512 and
               4096 tokens, Mixtral at 4096) it gets the rows as the MoE layer lays them
               out for prefill (`expert_routing.align_groups`): each expert's group padded to a
               multiple of 8 rows, `groups_aligned=True`
               (rows column: "aligned, R" = the layout's static row count); the floor and
               the peers keep the real rows
  ragged_dot   XLA's `ragged_dot_general` (the reference; on GPU a dense, zero-padded dot
               over all experts: E times the FLOPs). Skipped when that dense dot would take
               longer than --xla-max-seconds at the measured matmul rate.
  mgpu         jax's `ops/gpu/ragged_dot_mgpu.ragged_dot` (transpose_rhs=True takes the
               [E, N, K] stack as it is); the first of a few block configs that compiles
               and agrees with the reference is timed, else "n/a (why)".
  % floor      floor / ours; vs XLA: ragged_dot time / ours
--sweep also times a few other `Config`s of our kernel per cell (printed to the log).

Times are CUPTI kernel-time medians (`jaxinfer.benchmarks.harness.median_seconds`; host wall time on
the CPU). A cell that fails prints "n/a (reason)" and the table goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.benchmarks.harness import (
    Cell,
    disagreement,
    measure_ceilings,
    median_seconds,
    short,
    timed_cell,
)
from jaxinfer.mosaic import grouped_matmul as mgm
from jaxinfer.mosaic.grouped_matmul import grouped_matmul_mgpu, upcasts_in_registers
from jaxinfer.ops.expert_routing import aligns_groups
from jaxinfer.ops.grouped_matmul import GROUP_ALIGN, grouped_matmul_rows
from jaxinfer.ops.grouped_matmul_registry import (
    QUANT_ROWS_MAX_M,
    ROW_REDUCE_MAX_M,
    grouped_matmul,
)
from jaxinfer.ops.quant import dequantize, quantize

MODELS = {  # name: (experts, top_k, hidden, expert intermediate)
    "qwen3": ("qwen3-30b-a3b", 128, 8, 2048, 768),
    "mixtral": ("mixtral-8x7b", 8, 2, 4096, 14336),
    "gpt-oss": ("gpt-oss-20b", 32, 4, 2880, 2880),
    "smoke": ("cpu smoke", 8, 2, 256, 128),
}
PROJECTIONS = ("gate_up", "down")
TOKENS = (1, 8, 64, 512, 4096)


def projection_shape(proj: str, hidden: int, inter: int) -> tuple[int, int]:
    """(N, K) of one expert's weight."""
    return (2 * inter, hidden) if proj == "gate_up" else (hidden, inter)


def draw_routing(rng: np.random.Generator, tokens: int, experts: int, top_k: int):
    """group_sizes [E] int32 of `tokens` tokens each choosing top_k distinct experts."""
    choice = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    return np.bincount(choice.ravel(), minlength=experts).astype(np.int32)


def mgpu_candidates(rows: int) -> list[dict]:
    """Block configs for jax's ragged_dot_mgpu, best guess first."""
    bm = 64 if rows <= 4096 else 128
    return [dict(block_m=bm, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1),
            dict(block_m=64, block_n=64, block_k=64, max_concurrent_steps=4, grid_block_n=1)]


def sweep_configs(x, w):
    """Our default config for these shapes and a few neighbours (for --sweep): other token
    tiles, consumer counts, ring depths (down to 2, up to twice the default's, as fits),
    K pieces a step (every divisor of the pieces up to 16) and, for 32-bit words, two CTAs
    an SM (`Config.share_sm`: twice the CTAs, each ring in half the shared memory), alone
    and with half the token tile, or one where the default shares."""
    k = x.shape[1]
    base = mgm.default_config(x, w)
    bits, scales, piece, fp4_groups = mgm.weight_form(w, k)
    total = k // piece
    changes = [dict(max_rows=base.max_rows * 2, last_extra=0),
               dict(max_rows=base.max_rows // 2, last_extra=base.last_extra // 2),
               dict(last_extra=0 if base.last_extra else base.max_rows // 4),
               dict(compute_wgs=3 - base.compute_wgs, split_k=False),
               dict(num_stages=max(2, base.num_stages - 2)),
               dict(num_stages=2 * base.num_stages)]
    changes += [dict(k_pieces=d, split_k=base.split_k and d % 2 == 0)
                for d in range(1, 17) if total % d == 0 and d != base.k_pieces]
    changes.append(dict(max_rows=mgm.MIN_WIDTH, last_extra=0))
    if base.share_sm:  # one CTA an SM, its ring as deep as fits the whole shared memory
        changes.append(dict(share_sm=False, num_ctas=None, num_stages=8))
    elif base.words32:
        shared = dict(share_sm=True, num_ctas=2 * mgm.num_sms())
        changes += [shared, dict(shared, max_rows=base.max_rows // 2,
                                 last_extra=base.last_extra // 2)]
    out = [base]
    for change in changes:
        cfg = dataclasses.replace(base, **change)
        if not 8 <= cfg.max_rows <= 256:  # (no B width to run)
            continue
        room = mgm.SMEM_BYTES // 2 - 1024 if cfg.share_sm else mgm.SMEM_BYTES
        while (mgm.smem_bytes(cfg, 2, 1, bits, fp4_groups or scales == "group", False,
                              piece) > room and cfg.num_stages > 2):
            cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
        if (cfg.max_width <= 256 and cfg.last_extra % 8 == 0
                and cfg.last_extra < cfg.max_rows and k % (piece * cfg.k_pieces) == 0
                and cfg not in out):
            out.append(cfg)
    return out


def words32_config(x, w):
    """Our default config for these 4-bit experts, with their codes as 32-bit words under
    mma.sync (`Config.words32`; for --words32)."""
    return dataclasses.replace(mgm.default_config(x, w), words32=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="gate_up only, tokens in {1, 64, 4096}")
    ap.add_argument("--models", help="comma list of: qwen3, mixtral, gpt-oss "
                                     "(default qwen3,mixtral)")
    ap.add_argument("--proj", help="comma list of: gate_up, down (default both)")
    ap.add_argument("--tokens", help="comma list of token counts (default 1,8,64,512,4096)")
    ap.add_argument("--draws", type=int, default=4, help="routings cycled per cell")
    ap.add_argument("--iters", type=int, help="timed calls per cell (default 10; smoke 2)")
    ap.add_argument("--sweep", action="store_true", help="also time neighbouring configs")
    ap.add_argument("--no-mgpu", action="store_true", help="skip jax's ragged_dot_mgpu")
    ap.add_argument("--xla-max-seconds", type=float, default=2.0,
                    help="skip XLA's dense ragged_dot when it would take longer (default 2)")
    ap.add_argument("--max-minutes", type=float, default=8.0,
                    help="skip the cells left after this long (default 8)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="a tiny shape, 1 and 8 tokens: a quick check that runs on the CPU")
    ap.add_argument("--quantize", help="expert weights in this format (int8, int4:g128, ...)")
    ap.add_argument("--words32", action="store_true",
                    help="also time 4-bit experts as 32-bit words under mma.sync (the log)")
    ap.add_argument("--out", help="also write the table (markdown) here")
    a = ap.parse_args()

    gpu = jax.default_backend() == "gpu"
    models = "smoke" if a.cpu_smoke else a.models or "qwen3,mixtral"
    projs = a.proj or ("gate_up" if a.quick else ",".join(PROJECTIONS))
    tokens = a.tokens or ("1,8" if a.cpu_smoke else "1,64,4096" if a.quick else
                          ",".join(map(str, TOKENS)))
    models = [MODELS[s.strip()] for s in models.split(",")]
    projs = [p.strip() for p in projs.split(",")]
    tokens = [int(t) for t in tokens.split(",")]
    iters = a.iters or (2 if a.cpu_smoke else 10)
    bench = functools.partial(median_seconds, iters=iters, warmup=1 if a.cpu_smoke else 2)
    start = time.perf_counter()
    deadline = start + 60 * a.max_minutes

    c = measure_ceilings() if gpu else measure_ceilings(64 << 20, 512)
    header = [f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), "
              f"jax {jax.__version__}", c.line(),
              f"median of {iters} calls per cell, {a.draws} routings cycled",
              f"expert weights: {a.quantize or 'bf16'}"]
    if not gpu:
        header.append("not a GPU: host wall times; ours runs in Mosaic GPU interpret mode")
    print("\n".join(header), flush=True)

    ours = jax.jit(functools.partial(grouped_matmul, implementation="mosaic_gpu"))
    ours_aligned = jax.jit(functools.partial(grouped_matmul, implementation="mosaic_gpu",
                                             groups_aligned=True))
    ref = jax.jit(functools.partial(grouped_matmul, implementation="reference"))

    def timed(label, fn, arg_sets) -> Cell:
        return timed_cell(label, bench, fn, arg_sets, deadline)

    def checked(label, fn, arg_sets, want) -> tuple[Cell, str]:
        """fn timed after its output on the first arg set is compared with `want`."""
        if time.perf_counter() > deadline:
            return Cell(note="skipped (time budget)"), "-"
        try:
            got = fn(*arg_sets[0])
            err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
            rel = err / max(float(jnp.max(jnp.abs(want.astype(jnp.float32)))), 1e-30)
        except Exception as e:  # noqa: BLE001
            print(f"    {label}: {short(e, 300)}", flush=True)
            return Cell(note=f"n/a ({short(e, 60)})"), "-"
        if (why := disagreement(got, want, 2e-2)) is not None:
            print(f"    {label}: FAIL {why}", flush=True)
            return Cell(note=f"FAIL ({why})"), f"{rel:.2g}"
        return timed(label, fn, arg_sets), f"{rel:.2g}"

    def time_mgpu(x_sets, want) -> Cell:
        if not gpu:
            return Cell(note="n/a (Hopper GPU only)")
        if a.quantize:  # bf16 only: the dequantised stack
            w_bf16 = dequantize(x_sets[0][1], jnp.bfloat16)
            x_sets = [(x, w_bf16, gs) for x, _, gs in x_sets]
        from jax.experimental.pallas.ops.gpu.ragged_dot_mgpu import ragged_dot

        failures = []
        for cfg in mgpu_candidates(x_sets[0][0].shape[0]):
            fn = jax.jit(lambda x, w, gs, cfg=cfg: ragged_dot(
                x, w, group_sizes=gs, transpose_rhs=True, **cfg))
            cell, _ = checked(f"mgpu {cfg}", fn, x_sets, want)
            if cell.seconds is not None:
                return cell
            failures.append(cell.note)
        return Cell(note=failures[0] if failures else "n/a")

    rows, rng = [], np.random.default_rng(0)
    key = jax.random.key(0)
    for name, e, top_k, hidden, inter in models:
        for proj in projs:
            n, k = projection_shape(proj, hidden, inter)
            title = f"{name} {proj} [{e}, {n}, {k}]"
            print(f"{title} (at {time.perf_counter() - start:.0f} s)", flush=True)
            key, wkey = jax.random.split(key)
            w = (jax.random.normal(wkey, (e, n, k), jnp.float32) * 0.02).astype(jnp.bfloat16)
            w = quantize(w, a.quantize) if a.quantize else w
            expert_bytes = w.nbytes // e if a.quantize else n * k * 2
            for t in tokens:
                m = t * top_k
                sizes = [draw_routing(rng, t, e, top_k) for _ in range(a.draws)]
                hit = float(np.mean([(s > 0).sum() for s in sizes]))
                x = jax.random.normal(jax.random.fold_in(wkey, t), (m, k), jnp.bfloat16)
                arg_sets = [(x, w, jnp.asarray(s)) for s in sizes]
                aligned = aligns_groups(m, e)  # the MoE layer's prefill layout
                if aligned:
                    r = -(-(m + (GROUP_ALIGN - 1) * min(e, m)) // GROUP_ALIGN) * GROUP_ALIGN
                    x_al = jax.random.normal(jax.random.fold_in(wkey, t + 1), (r, k),
                                             jnp.bfloat16)
                    our_sets = [(x_al, w, jnp.asarray(-(-s // GROUP_ALIGN) * GROUP_ALIGN))
                                for s in sizes]
                    our_fn, rows_text = ours_aligned, f"{m} (aligned, {r})"
                else:
                    our_sets, our_fn, rows_text = arg_sets, ours, f"{m}"
                bytes_hit = hit * expert_bytes
                bw_floor = bytes_hit / c.copy_bytes_per_s
                flop_floor = 2 * m * n * k / c.matmul_flops_per_s
                label = f"{name} {proj} tokens={t}"
                try:
                    want = ref(*arg_sets[0]) if gpu or e * m * n * k < 1e10 else None
                    want_ours = (ref(*our_sets[0]) if aligned and want is not None
                                 else want)
                except Exception as ex:  # noqa: BLE001
                    print(f"    {label} reference: {short(ex, 300)}", flush=True)
                    want = want_ours = None
                if want_ours is None:
                    cell_ours, err = timed(f"{label} ours", our_fn, our_sets), "no ref"
                else:
                    cell_ours, err = checked(f"{label} ours", our_fn, our_sets, want_ours)
                dense_s = 2 * e * m * n * k / c.matmul_flops_per_s
                if dense_s > a.xla_max_seconds:
                    cell_xla = Cell(note=f"skipped (dense: ~{dense_s:.0f} s)")
                else:
                    cell_xla = timed(f"{label} ragged_dot", ref, arg_sets)
                cell_mgpu = (Cell(note="skipped") if a.no_mgpu or want is None
                             else time_mgpu(arg_sets, want))
                # XLA's row reduction: where it is the decode default (float rows at one
                # token; formats the kernel would dequantise whole, to min(E, 128) rows),
                # and at one token for int8 / int4 too, for comparison.
                by_row = (min(e, QUANT_ROWS_MAX_M) if a.quantize and not upcasts_in_registers(w)
                          else 0 if a.quantize else ROW_REDUCE_MAX_M)
                if m <= max(by_row, ROW_REDUCE_MAX_M) and want is not None:
                    rows_fn = jax.jit(lambda x, w, gs: grouped_matmul_rows(
                        x, w, jnp.repeat(jnp.arange(gs.shape[0], dtype=jnp.int32), gs,
                                         total_repeat_length=x.shape[0])))
                    role = "the default" if m <= by_row else "for comparison"
                    checked(f"{label} grouped_matmul_rows ({role})", rows_fn, arg_sets, want)
                if a.sweep and gpu:
                    for cfg in sweep_configs(our_sets[0][0], w):
                        fn = jax.jit(functools.partial(grouped_matmul_mgpu, config=cfg,
                                                       groups_aligned=aligned))
                        checked(f"{label} sweep {cfg}", fn, our_sets, want_ours)
                if a.words32 and a.quantize and w.kind in ("int4", "fp4"):
                    cfg = words32_config(our_sets[0][0], w)
                    fn = jax.jit(functools.partial(grouped_matmul_mgpu, config=cfg,
                                                   groups_aligned=aligned))
                    checked(f"{label} words32", fn, our_sets, want_ours)
                rows.append(dict(shape=title, tokens=t, rows=rows_text, hit=hit,
                                 floor_s=max(bw_floor, flop_floor),
                                 floor_kind="bw" if bw_floor >= flop_floor else "flop",
                                 ours=cell_ours, xla=cell_xla, mgpu=cell_mgpu, err=err))
            del w
            write_table(header, rows, a.out)
    print(f"done in {time.perf_counter() - start:.0f} s", flush=True)


def write_table(header: list[str], rows: list[dict], path: str | None):
    """Prints the table so far (and rewrites `path`), so that a run cut off keeps it."""
    out = ["| shape | tokens | rows | experts hit | floor (us) | ours (us) | ragged_dot (us) "
           "| ragged_dot_mgpu (us) | ours % floor | vs ragged_dot | ours err |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ours, xla = r["ours"], r["xla"]
        pct = (f"{100 * r['floor_s'] / ours.seconds:.0f}%" if ours.seconds else "-")
        speedup = (f"{xla.seconds / ours.seconds:.1f}x" if ours.seconds and xla.seconds
                   else "-")
        out.append(f"| {r['shape']} | {r['tokens']} | {r['rows']} | {r['hit']:.1f} | "
                   f"{r['floor_s'] * 1e6:.1f} ({r['floor_kind']}) | {ours.text()} | "
                   f"{xla.text()} | {r['mgpu'].text()} | {pct} | {speedup} | {r['err']} |")
    table = "\n".join(out)
    print("\n" + table + "\n", flush=True)
    if path:
        with open(path, "w") as fh:
            fh.write("\n".join(header) + "\n\n" + table + "\n")


if __name__ == "__main__":
    main()
