"""The options every model-running command shares: meshes, multi-host jobs, scanned layers."""

from __future__ import annotations

import click
import jax.numpy as jnp

from jaxinfer.engine import multihost
from jaxinfer.loading.plan import DEFAULT_MEMORY_UTILIZATION
from jaxinfer.loading.presets import RandomWeights, preset_config
from jaxinfer.sharding import MeshSpec

memory_utilization_option = click.option(
    "--gpu-memory-utilization", default=DEFAULT_MEMORY_UTILIZATION, show_default=True,
    type=click.FloatRange(0, 1, min_open=True),
    help="Share of each GPU's (or TPU's) memory the engine takes: the weights, a step's "
         "reserve and, unless --kv-cache-gb says otherwise, the KV cache in the rest (vLLM's "
         "flag; XLA_PYTHON_CLIENT_MEM_FRACTION, if set, bounds it).")

kv_cache_dtype_option = click.option(
    "--kv-cache-dtype", type=click.Choice(["auto", "fp8"]), default="auto", show_default=True,
    help="The KV cache's dtype: auto (the model's) or fp8 (float8_e4m3fn, scale 1: half the "
         "bytes of bf16 a token, as vLLM's --kv-cache-dtype fp8).")

batch_invariant_option = click.option(
    "--batch-invariant", is_flag=True,
    help="Each request's tokens and logprobs bitwise the same whatever shares its batch "
         "(slower; CPUs, and GPUs for dense models, so far).")

scan_layers_option = click.option(
    "--scan-layers/--no-scan-layers", default=None,
    help="Run the layers as a scan over stacked weights: step programs compile in half the "
         "time or less, decode runs slower (default: off; env JAXINFER_SCAN_LAYERS=1).")


def parallel_options(fn):
    """--mesh, and --coordinator / --num-processes / --process-id (or their environment
    variables) for a multi-process job; the command receives them as keyword arguments."""
    opts = [
        click.option("--mesh", default=None, metavar="SPEC",
                     help="Split the model over devices: tp=N (tensor), ep=N (experts), dp=N "
                          "(engine replicas), e.g. tp=2,ep=4 (default: one device)."),
        click.option("--coordinator", envvar="JAXINFER_COORDINATOR", default=None,
                     metavar="HOST:PORT",
                     help="Multi-process job: process 0's address (jax.distributed)."),
        click.option("--num-processes", envvar="JAXINFER_NUM_PROCESSES", default=None,
                     type=click.IntRange(min=1), help="Multi-process job: processes in all."),
        click.option("--process-id", envvar="JAXINFER_PROCESS_ID", default=None,
                     type=click.IntRange(min=0),
                     help="Multi-process job: this process (0 serves and schedules)."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def join_job(coordinator, num_processes, process_id) -> bool:
    """Joins the multi-process job if one is given; True on process 0 (or alone)."""
    multihost.initialize(coordinator, num_processes, process_id)
    return multihost.is_leader()


def random_or_path(model_path, preset, dtype, mesh, quantize=None):
    """--preset: random weights made straight onto the mesh (their projections quantized to
    `quantize` if given), which `LLM` makes while it compiles; else the path."""
    if not preset:
        return model_path
    return RandomWeights(preset_config(preset), jnp.dtype(dtype or "bfloat16"),
                         mesh=MeshSpec.parse(mesh).meshes()[0], quantize=quantize)
