"""Runs one 4-bit Mosaic matmul a few times on random weights, for Nsight Compute: the dense
kernel at one token on a Llama-3-8B projection as the model calls it (int4:g128 unless a
format is given), or gpt-oss-20b's MXFP4 experts' gate_up at one token (four rows, four
experts). Prints the config the kernel picks.

    ncu --clock-control none -k regex:mosaic --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section SchedulerStats \\
        python3 bench/ncu_quantized_kernels.py gate_up [int4:g128] [--share-sm 0|1]
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.mosaic import grouped_matmul as gmm
from jaxinfer.mosaic import quantized_matmul as qmm
from jaxinfer.ops.quant import quantize

DENSE = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
         "down": (4096, 14336)}  # (N, K)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kernel", choices=[*DENSE, "experts"])
    ap.add_argument("format", nargs="?", default="int4:g128")
    ap.add_argument("--share-sm", type=int, choices=(0, 1),
                    help="dense: force Config.share_sm (default: the kernel's choice)")
    a = ap.parse_args()
    key = jax.random.key(0)
    if a.kernel in DENSE:
        n, k = DENSE[a.kernel]
        w = quantize(jax.random.normal(key, (n, k), jnp.bfloat16) * 0.02, a.format)
        x = jax.random.normal(jax.random.fold_in(key, 1), (1, k), jnp.bfloat16)
        cfg = qmm.default_config(x, w)
        if a.share_sm is not None:
            cfg = dataclasses.replace(cfg, share_sm=bool(a.share_sm))
        fn = jax.jit(lambda x, w: qmm.quantized_matmul_mgpu(x, w, config=cfg))
    else:
        e, n, k = 32, 5760, 2880
        w = quantize(jax.random.normal(key, (e, n, k), jnp.bfloat16) * 0.02, "mxfp4")
        x = jax.random.normal(jax.random.fold_in(key, 1), (4, k), jnp.bfloat16)
        group_sizes = jnp.zeros((e,), jnp.int32).at[jnp.array([3, 7, 11, 20])].set(1)
        cfg = gmm.default_config(x, w)
        fn = jax.jit(lambda x, w: gmm.grouped_matmul_mgpu(x, w, group_sizes, config=cfg))
    print(cfg, flush=True)
    for _ in range(6):
        y = fn(x, w)
    print(a.kernel, y.shape, float(jnp.abs(y.astype(jnp.float32)).mean()))


if __name__ == "__main__":
    main()
