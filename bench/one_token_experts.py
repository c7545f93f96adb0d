"""One decode token's expert products on the GPU: the Mosaic grouped matmul against XLA's
multiply and row reduction over the gathered experts.

  python bench/one_token_experts.py

For Qwen3-30B-A3B (top-8 of 128) and Mixtral-8x7B (top-2 of 8) expert shapes, bf16, one
token: its k rows (each its own group, in the router's order, as `jaxinfer.models.moe`
passes them) through gate_up with the SwiGLU, then down; each form alone and the pair in
one jit. CUPTI medians (`jaxinfer.benchmarks.harness.kernel_times`) over calls on other
random experts each; each measured call follows an untimed one on the same experts, so
what of them fits in L2 is read from there. The copy bandwidth is measured in the same run.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.benchmarks.harness import kernel_times, measure_ceilings
from jaxinfer.ops.grouped_matmul import RowGroups, grouped_matmul_rows
from jaxinfer.ops.grouped_matmul_registry import grouped_matmul

SHAPES = {  # E, k, H (model width), I (expert width)
    "qwen3": (128, 8, 2048, 768),
    "mixtral": (8, 2, 4096, 14336),
}


def mosaic(x_rows, w, group, swiglu):
    e = w.shape[0]
    m = x_rows.shape[0]
    sizes = jnp.sum(group[:, None] == jnp.arange(e)[None, :], axis=0, dtype=jnp.int32)
    rows = jnp.arange(m, dtype=jnp.int32)
    return grouped_matmul(x_rows, w, sizes, row_groups=RowGroups(group, rows, rows + 1),
                          swiglu=swiglu, rows_sorted=False, implementation="mosaic_gpu")


def gathered_reduce(x_rows, w, group, swiglu):
    """The form `grouped_matmul` picks on Hopper for one token's rows."""
    return grouped_matmul_rows(x_rows, w, group, swiglu=swiglu)


def pair(form):
    def run(x_rows, w_gate_up, w_down, group):
        return form(form(x_rows, w_gate_up, group, True), w_down, group, False)
    return run


def main():
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()  # --help
    ceilings = measure_ceilings()
    print(ceilings.line(), flush=True)
    copy = ceilings.copy_bytes_per_s
    for name, shape in SHAPES.items():
        bench_shape(name, *shape, copy)


def bench_shape(name, e, k, h, i, copy):
    kg = jax.random.split(jax.random.key(0), 4)
    w_gate_up = jax.random.normal(kg[0], (e, 2 * i, h), jnp.bfloat16)
    w_down = jax.random.normal(kg[1], (e, h, i), jnp.bfloat16)
    x = jax.random.normal(kg[2], (1, h), jnp.bfloat16)
    rng = np.random.default_rng(1)
    groups = [jnp.asarray(rng.permutation(e)[:k], jnp.int32) for _ in range(64)]
    gu_bytes, down_bytes = k * 2 * i * h * 2, k * h * i * 2
    x_rows = jnp.broadcast_to(x, (k, h))
    h_rows = jax.random.normal(kg[3], (k, i), jnp.bfloat16)
    cases = (("gate_up+swiglu", [(x_rows, w_gate_up, g) for g in groups], gu_bytes),
             ("down", [(h_rows, w_down, g) for g in groups], down_bytes),
             ("both", [(x_rows, w_gate_up, w_down, g) for g in groups], gu_bytes + down_bytes))
    ref = pair(gathered_reduce)(x_rows.astype(jnp.float32), w_gate_up, w_down, groups[0])
    for label, form in (("mosaic", mosaic), ("xla gather-reduce", gathered_reduce)):
        fns = (jax.jit(lambda xr, w, g, form=form: form(xr, w, g, True)),
               jax.jit(lambda xr, w, g, form=form: form(xr, w, g, False)),
               jax.jit(pair(form)))
        got = fns[2](x_rows, w_gate_up, w_down, groups[0]).astype(jnp.float32)
        err = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
        for fn, (what, arg_sets, nbytes) in zip(fns, cases, strict=True):
            # each measured call on other random experts: 40 of the 64 expert draws
            seconds, per_kernel = kernel_times(fn, arg_sets, iters=40, warmup=3)
            us = seconds * 1e6
            kernels = {n[:28]: round(t * 1e6, 2) for n, t in per_kernel}
            gbps = nbytes / us / 1e3
            print(f"{name:8s} {label:18s} {what:15s} {us:8.2f} us {gbps:6.0f} GB/s = "
                  f"{gbps * 1e9 / copy:6.1%} of copy  rel.err {err:.1e}  {kernels}",
                  flush=True)


if __name__ == "__main__":
    main()
