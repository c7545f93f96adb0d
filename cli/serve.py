"""`jaxinfer serve`: the OpenAI-compatible HTTP server (jaxinfer/serving/server.py) on one model."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import click

from jaxinfer.cli.parallel import (
    batch_invariant_option,
    join_job,
    kv_cache_dtype_option,
    memory_utilization_option,
    parallel_options,
    random_or_path,
    scan_layers_option,
)
from jaxinfer.engine.defaults import describe
from jaxinfer.errors import JaxinferError
from jaxinfer.llm import LLM
from jaxinfer.loading.plan import set_memory_utilization


def _seconds_since_process_start() -> float | None:
    """From /proc (Linux): the process's age, so "ready in" includes Python's imports."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound (not yet listening) to host:port, so a taken port fails before loading."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise JaxinferError(f"--host {host} --port {port}: cannot listen there "
                            f"({e.strerror or e})") from None
    return sock


@click.command()
@click.option("--model", "model_path", default=None,
              help="Converted dir, HF dir or .gguf file (default: embedded SmolLM2-135M-Instruct).")
@click.option("--preset", default=None,
              help="A random-weight model of a named shape instead (token-id prompts only).")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32", "float16"]), default=None,
              help="Compute dtype (default: as stored; bfloat16 for HF/GGUF sources and presets).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind (0.0.0.0 exposes the server to the network).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="0 picks a free port (printed when ready).")
@click.option("--api-key", default=None, envvar="JAXINFER_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1/* (env JAXINFER_API_KEY).")
@click.option("--served-model-name", default=None,
              help="The model name clients send (default: the --model or --preset value).")
@click.option("--max-num-seqs", default=None, type=click.IntRange(min=1),
              help=f"Most sequences in one step ({describe('max_num_seqs')}).")
@click.option("--max-num-batched-tokens", default=None, type=click.IntRange(min=1),
              help="Most tokens (prompt chunks and decodes) in one step "
                   f"({describe('max_num_batched_tokens')}).")
@click.option("--kv-cache-gb", default=None, type=click.FloatRange(min=0, min_open=True),
              help="Size of the paged KV cache in GiB (default: on a GPU or TPU what "
                   "--gpu-memory-utilization leaves after the weights and a step's reserve; "
                   "on the CPU what --max-num-seqs sequences of --max-model-len need, at most "
                   "1).")
@memory_utilization_option
@kv_cache_dtype_option
@batch_invariant_option
@click.option("--max-model-len", default=None, type=click.IntRange(min=2),
              help="Longest prompt + output (default: the model's context, capped by the cache).")
@click.option("--decode-steps", default=None, type=click.IntRange(min=1),
              help="Decode steps per engine step (more: fewer host round trips; "
                   f"{describe('decode_steps')}).")
@click.option("--page-size", default=16, show_default=True, type=click.IntRange(min=1),
              help="Tokens per KV-cache page (prefix caching shares whole pages).")
@click.option("--no-warmup", is_flag=True, help="Skip compiling the step buckets at start.")
@scan_layers_option
@parallel_options
def serve(model_path, preset, dtype, host, port, api_key, served_model_name, max_num_seqs,
          max_num_batched_tokens, kv_cache_gb, gpu_memory_utilization, kv_cache_dtype,
          batch_invariant, max_model_len, decode_steps, page_size, no_warmup, scan_layers, mesh,
          coordinator, num_processes, process_id):
    """Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions,
    /v1/models, /health, /metrics)."""
    start = time.perf_counter() - (_seconds_since_process_start() or 0.0)
    try:
        from jaxinfer.serving.server import run_server
    except ImportError as e:
        raise JaxinferError(f"jaxinfer serve needs the 'serve' extra (in a checkout: bash "
                            f".ci/venv serve; else pip install 'jaxinfer[serve]'): {e}") from None

    if model_path and preset:
        raise JaxinferError("--model and --preset: give one, not both")
    set_memory_utilization(gpu_memory_utilization)  # before JAX starts
    leader = join_job(coordinator, num_processes, process_id)
    sock = _bind(host, port) if leader else None  # only process 0 serves HTTP
    if sock is not None:
        # Listening from now on: a client connecting while the model loads waits in the
        # backlog (then gets /health's 503 until warm-up is done), never a refusal.
        sock.listen(2048)
    model = random_or_path(model_path, preset, dtype, mesh)
    llm = LLM(model, dtype=None if preset else dtype,
              kv_cache_bytes=None if kv_cache_gb is None else int(kv_cache_gb * 2**30),
              max_model_len=max_model_len, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=max_num_batched_tokens, decode_steps=decode_steps,
              page_size=page_size, mesh=mesh, scan_layers=scan_layers,
              gpu_memory_utilization=gpu_memory_utilization, kv_cache_dtype=kv_cache_dtype,
              start_warmup=not no_warmup, batch_invariant=batch_invariant)
    if not leader:  # runs process 0's steps until it exits
        llm.follow()
        return
    if llm.kv_plan is not None:
        click.echo(llm.kv_plan.format(page_size), err=True)
    name = served_model_name or preset or model_path or "SmolLM2-135M-Instruct"
    bound_host, bound_port = sock.getsockname()[:2]
    url = f"http://{f'[{bound_host}]' if ':' in bound_host else bound_host}:{bound_port}"
    if not no_warmup:
        click.echo(f"model loaded in {time.perf_counter() - start:.1f} s; warming up on {url} "
                   "(/health answers 503 until ready)")

    def on_ready():
        stats = llm.engine.stats()
        click.echo(f"ready in {time.perf_counter() - start:.1f} s on {url} "
                   f"({stats.num_programs_compiled} step programs compiled, "
                   f"{stats.num_programs_loaded} loaded from the cache)")

    run_server(llm, name, sock, api_key=api_key, warmup=not no_warmup, on_ready=on_ready)
