"""`jaxinfer plan`: per-device memory of a model on a mesh (`jaxinfer.loading.plan`); nothing
is loaded."""

from __future__ import annotations

import dataclasses
import json

import click

from jaxinfer.engine.defaults import ACCELERATOR_DEFAULTS
from jaxinfer.errors import JaxinferError
from jaxinfer.loading.plan import (
    DEFAULT_MEMORY_UTILIZATION,
    GiB,
    model_tensors,
    plan_memory,
    suggest_mesh,
)
from jaxinfer.sharding import MeshSpec


@click.command()
@click.option("--model", required=True, metavar="NAME|PATH",
              help="A preset (llama3-8b, llama3-70b, qwen3-8b, qwen3-30b-a3b, mixtral-8x7b, "
                   "gpt-oss-20b, tiny, tiny-moe) or a checkpoint (converted dir, HF dir, .gguf).")
@click.option("--mesh", default=None, metavar="SPEC",
              help="tp=N, ep=N, dp=N, e.g. tp=2,ep=4 (default: one device).")
@click.option("--gpus", default=None, type=click.IntRange(min=1),
              help="Instead of --mesh: suggest a layout of this many devices (the fewest a "
                   "replica fits on, the rest as dp replicas) and plan it.")
@click.option("--hbm-gb", required=True, type=click.FloatRange(min=0, min_open=True),
              help="Memory per device in GiB (2^30 bytes), e.g. 141 for an H200.")
@click.option("--context", default=None, type=click.IntRange(min=1),
              help="Tokens per sequence for --max seqs (default: the model's context, capped "
                   "at 8192).")
@click.option("--page-size", default=16, show_default=True, type=click.IntRange(min=1))
@click.option("--dtype", type=click.Choice(["bfloat16", "float32", "float16"]), default=None,
              help="Float dtype (default: as stored for a converted checkpoint, else bfloat16).")
@click.option("--quantize", default=None, metavar="FORMAT",
              help="Plan the projections quantized as `jaxinfer convert --quantize FORMAT` "
                   "stores them (presets, HF / GGUF sources).")
@click.option("--gpu-memory-utilization", "--memory-fraction", "memory_fraction",
              default=DEFAULT_MEMORY_UTILIZATION, show_default=True,
              type=click.FloatRange(0, 1, min_open=True),
              help="Share of --hbm-gb the engine may use (as `serve --gpu-memory-utilization`, "
                   "which sizes JAX's pool to it).")
@click.option("--reserve-gb", default=None, type=click.FloatRange(min=0),
              help="Per-device room for a step's temporaries (default: an estimate from "
                   "--max-num-seqs and --max-num-batched-tokens, see jaxinfer.loading.plan).")
@click.option("--max-num-seqs", default=ACCELERATOR_DEFAULTS.max_num_seqs, show_default=True,
              type=click.IntRange(min=1), help="As `jaxinfer serve` on a GPU or TPU.")
@click.option("--max-num-batched-tokens", default=ACCELERATOR_DEFAULTS.max_num_batched_tokens,
              show_default=True, type=click.IntRange(min=1),
              help="As `jaxinfer serve` on a GPU or TPU.")
@click.option("--json", "json_path", default=None, help="Write the plan as JSON.")
def plan(model, mesh, gpus, hbm_gb, context, page_size, dtype, quantize, memory_fraction,
         reserve_gb, max_num_seqs, max_num_batched_tokens, json_path):
    """Weight bytes per device, KV pages that fit and concurrent sequences at a context."""

    if mesh is not None and gpus is not None:
        raise JaxinferError("--mesh and --gpus: give one (--gpus suggests a mesh)")
    spec = MeshSpec.parse(mesh)  # a bad spec fails before the model is read
    config, tensors = model_tensors(model, dtype, quantize)
    kwargs = dict(tensors=tensors, page_size=page_size, context=context,
                  memory_fraction=memory_fraction,
                  reserve_bytes=None if reserve_gb is None else int(reserve_gb * GiB),
                  max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                  name=model)
    if gpus is None:
        result = plan_memory(config, spec, int(hbm_gb * GiB), **kwargs)
    else:
        spec, result = suggest_mesh(config, gpus, int(hbm_gb * GiB), **kwargs)
        click.echo(f"suggested    --mesh {spec} for {gpus} device(s): the fewest a replica "
                   f"fits on, the rest replicas (more tp: lower latency, fewer tokens per GPU)")
    click.echo(result.format())
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dataclasses.asdict(result), f, indent=2)
