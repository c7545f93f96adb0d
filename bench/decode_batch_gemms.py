"""Float GEMMs of a decode batch (M = 16..128 tokens): XLA's pick against split-K variants.

    python bench/decode_batch_gemms.py [--preset llama3-8b] [--ms 32,64,128] [--iters 30]

y = x @ W^T, x [M, K] bf16, W [N, K] bf16, for each projection of the preset (the fused
q/k/v and gate/up, o, down). Variants, each a jitted function timed on the same inputs:

  xla          `jaxinfer.ops.linear_registry.linear` as the model calls it (XLA's autotuned pick).
  cublas       the same, compiled with Triton GEMMs off (cuBLAS only).
  splitK=s     x and W cut into s pieces along K, one batched dot [s, M, N] in float32,
               summed over s; W viewed as [N, s, K/s] (XLA may copy it to batch-major).
  pre=s        the same with W stored batch-major, [s, N, K/s] (arranged once, untimed).
  grouped      the Mosaic grouped matmul (`jaxinfer.mosaic.grouped_matmul`) as one group of
               M rows, with its own tile choice (`choose_config`: 128-row token windows
               at M = 256)
  grouped256   the same with 256-row token windows (one window at M = 256)

Times are CUPTI kernel-time medians with the weight read from one of several copies in
turn (more bytes than the L2 holds), as a decode step streams each layer's own weights.
XLA's autotuner times its candidates on one weight, which may sit in L2 (the o
projection's 33.5 MB fits in an H100's 50 MB): a pick that is fast from L2 can be slow
from HBM. Floor: weight bytes over the copy bandwidth measured in the same run. Each
variant's output is checked against a float32 dot of the same inputs first.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.benchmarks.harness import Rotating, copies, measure_ceilings, median_seconds
from jaxinfer.loading.presets import preset_config
from jaxinfer.ops.linear_registry import linear


def one_group(x, w, max_rows: int | None = None):
    """x [M, K] @ W^T through the Mosaic grouped matmul, as one group of M rows."""
    from jaxinfer.mosaic import grouped_matmul as gm  # GPU only

    m, k = x.shape
    config = None
    if max_rows is not None:
        config = dataclasses.replace(gm.choose_config(m, 1, w.shape[0], k, gm.num_sms()),
                                     max_rows=max_rows, last_extra=0, num_stages=3)
    return gm.grouped_matmul_mgpu(x, w[None], jnp.full((1,), m, jnp.int32),
                                  groups_aligned=m % 8 == 0, config=config)


def projections(config) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of the decoder's projections, q/k/v and gate/up fused."""
    h, d = config.hidden_size, config.head_dim
    qkv = (config.num_heads + 2 * config.num_kv_heads) * d
    return {"qkv": (qkv, h), "o": (h, config.num_heads * d),
            "gate_up": (2 * config.intermediate_size, h), "down": (h, config.intermediate_size)}


def split_k(x, w, s: int, stored: bool = False):
    """x [M, K] @ W^T as s K-pieces: W [N, K], or [s, N, K/s] when stored batch-major."""
    m, k = x.shape
    xs = x.reshape(m, s, k // s)
    if stored:
        y = jax.lax.dot_general(xs, w, (((2,), (2,)), ((1,), (0,))),
                                preferred_element_type=jnp.float32)
    else:
        ws = w.reshape(w.shape[0], s, k // s)
        y = jax.lax.dot_general(xs, ws, (((2,), (2,)), ((1,), (1,))),
                                preferred_element_type=jnp.float32)
    return y.sum(0).astype(x.dtype)


def batch_major(w, s: int):
    n, k = w.shape
    return jnp.transpose(w.reshape(n, s, k // s), (1, 0, 2))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--ms", default="32,64,128")
    ap.add_argument("--splits", default="2,4")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--variants", default=None,
                    help="comma-separated labels to run (default: all but the grouped ones)")
    args = ap.parse_args()
    c = measure_ceilings()
    print(c.line(), flush=True)
    # label -> (jitted fn(x, w), how w is laid out for it, once, untimed)
    as_is = lambda w: w  # noqa: E731
    variants = {"xla": (jax.jit(linear), as_is),
                "cublas": (jax.jit(linear, compiler_options={
                    "xla_gpu_enable_triton_gemm": False}), as_is)}
    for s in map(int, args.splits.split(",")):
        variants[f"splitK={s}"] = (jax.jit(functools.partial(split_k, s=s)), as_is)
        variants[f"pre={s}"] = (jax.jit(functools.partial(split_k, s=s, stored=True)),
                                functools.partial(batch_major, s=s))
    variants["grouped"] = (jax.jit(one_group), as_is)
    variants["grouped256"] = (jax.jit(functools.partial(one_group, max_rows=256)), as_is)
    chosen = (args.variants.split(",") if args.variants
              else [v for v in variants if not v.startswith("grouped")])
    if unknown := sorted(set(chosen) - set(variants)):
        ap.error(f"--variants {','.join(unknown)}: expected some of {','.join(variants)}")
    variants = {v: variants[v] for v in chosen}
    key = jax.random.key(0)
    print("| proj | N x K | M | floor us | " + " | ".join(variants) + " | best % floor |")
    print("| --- " * (5 + len(variants)) + "|")
    for name, (n, k) in projections(preset_config(args.preset)).items():
        w = jax.random.normal(jax.random.fold_in(key, n * k), (n, k), jnp.bfloat16) / k**0.5
        w_copies = copies(w, 2 * n * k)
        floor = 2 * n * k / c.copy_bytes_per_s
        for m in map(int, args.ms.split(",")):
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.bfloat16)
            want = np.asarray(x, np.float32) @ np.asarray(w, np.float32).T
            cells = []
            for fn, arranged in variants.values():
                got = np.asarray(fn(x, arranged(w)), np.float32)
                err = np.abs(got - want).max() / np.abs(want).max()
                if not err < 2e-2:
                    cells.append(f"FAIL ({err:.2g})")
                    continue
                arg_sets = [(x, arranged(wc)) for wc in w_copies]
                t = median_seconds(Rotating(fn, arg_sets), iters=args.iters)
                del arg_sets
                cells.append(t)
            times = [t for t in cells if isinstance(t, float)]
            row = [f"{t * 1e6:.1f}" if isinstance(t, float) else t for t in cells]
            best = floor / min(times) if times else float("nan")
            print(f"| {name} | {n} x {k} | {m} | {floor * 1e6:.1f} | " + " | ".join(row)
                  + f" | {best:.0%} |", flush=True)


if __name__ == "__main__":
    main()
