"""`jaxinfer bench kernels | latency | throughput | serve`: thin commands over
`jaxinfer.benchmarks` (harness: timing and ceilings; kernels; end_to_end: latency and
throughput; serve_load: the HTTP load generator).

Each prints a roofline table (ceilings measured in the same run) and can write the
result as JSON (`--json`) and append a row to a results file (`--record bench/RESULTS.md`).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import shlex
import socket
import subprocess
import sys
import time

import click
import jax

from jaxinfer import LLM
from jaxinfer.benchmarks.end_to_end import bench_latency, bench_throughput
from jaxinfer.benchmarks.harness import (
    Ceilings,
    ceilings_in_child_process,
    format_rows,
    measure_ceilings,
    roofline,
)
from jaxinfer.benchmarks.kernels import bench_kernels
from jaxinfer.cli.parallel import random_or_path
from jaxinfer.errors import JaxinferError
from jaxinfer.loading.weights import StepReads
from jaxinfer.ops.quant import parse_format


@click.group()
def bench():
    """Benchmarks with a roofline report."""


def _model_options(fn):
    opts = [
        click.option("--model", "model_path", default=None,
                     help="Checkpoint (converted dir, HF dir, .gguf); default: --preset."),
        click.option("--preset", default=None,
                     help="Random-weight model shape (llama3-8b, llama3-70b, qwen3-8b, "
                          "qwen3-30b-a3b, mixtral-8x7b, gpt-oss-20b, tiny, tiny-moe)."),
        click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16",
                     show_default=True),
        click.option("--quantize", default=None, metavar="FORMAT",
                     help="With --preset: quantize the random projections to FORMAT (int8, "
                          "int4:g128, fp8, ...), as `jaxinfer convert --quantize` would."),
        click.option("--kv-cache-gb", type=float, default=4.0, show_default=True),
        click.option("--max-num-seqs", type=click.IntRange(min=1), default=64,
                     show_default=True),
        click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=2048,
                     show_default=True),
        click.option("--decode-steps", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Decode steps per host round trip (when every request decodes)."),
        click.option("--page-size", type=click.IntRange(min=1), default=16, show_default=True,
                     help="Tokens per KV-cache page."),
        click.option("--json", "json_path", default=None, help="Write the result as JSON."),
        click.option("--record", default=None, help="Append a row to this markdown file."),
        click.option("--profile", default=None, help="Write a jax.profiler trace to this dir."),
        click.option("--mesh", default=None, metavar="SPEC",
                     help="Split the model over devices, e.g. tp=2 (see `jaxinfer serve`)."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def _check_model_args(model_path, preset, quantize):
    """The model options' own errors, before anything is measured or loaded."""
    if preset and model_path:
        raise JaxinferError("give --model or --preset, not both")
    if quantize and not preset:
        raise JaxinferError("--quantize goes with --preset; quantize a checkpoint with "
                            "`jaxinfer convert --quantize`")
    if quantize:
        parse_format(quantize)


def _load(model_path, preset, dtype, kv_cache_gb, max_num_seqs, max_num_batched_tokens,
          decode_steps, page_size, mesh=None, quantize=None):
    _check_model_args(model_path, preset, quantize)
    model = random_or_path(model_path, preset, dtype, mesh, quantize)
    return LLM(model, dtype=None if preset else dtype,
               kv_cache_bytes=int(kv_cache_gb * 2**30), max_num_seqs=max_num_seqs,
               max_num_batched_tokens=max_num_batched_tokens, decode_steps=decode_steps,
               page_size=page_size, mesh=mesh)


def _report(kind, ceilings, rows, headline, result, json_path, record):
    """Prints the ceilings, the headline and the roofline rows; writes JSON / a results row."""
    device = jax.devices()[0].device_kind
    command = "jaxinfer " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    table = "\n\n".join(x for x in (ceilings.line(), headline, rows and format_rows(rows)) if x)
    full = {"kind": kind, "date": datetime.date.today().isoformat(), "device": device,
            "jax": jax.__version__, "command": command, "ceilings": vars(ceilings), **result,
            "rows": rows}
    click.echo(table)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(full, f, indent=2, default=float)
    if record:
        with open(record, "a") as f:
            f.write(f"\n### {full['date']} · {device} · jax {jax.__version__} · bench {kind}\n\n"
                    f"`{command}`\n\n{table}\n")


def _profiled(profile_dir):
    return jax.profiler.trace(profile_dir) if profile_dir else contextlib.nullcontext()


@bench.command()
@click.option("--backend", type=click.Choice(["reference"]), default="reference",
              show_default=True)
@click.option("--small", is_flag=True, help="Small shapes (CPU smoke runs).")
@click.option("--json", "json_path", default=None)
@click.option("--record", default=None)
@click.option("--profile", default=None)
@click.option("--plot", default=None, help="Draw the roofline to this PNG (needs matplotlib).")
def kernels(backend, small, json_path, record, profile, plot):
    """Attention and linear kernels against the device ceilings measured in the same run."""
    with _profiled(profile):
        ceilings = measure_ceilings()
        rows = bench_kernels(ceilings, backend, small=small)
    _report("kernels", ceilings, rows, None, {}, json_path, record)
    if plot:
        _plot(rows, ceilings, plot)


@bench.command()
@_model_options
@click.option("--batch", type=int, default=1, show_default=True)
@click.option("--input-len", type=int, default=128, show_default=True)
@click.option("--output-len", type=int, default=128, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Timed runs after the compiling one; the report gives their medians.")
def latency(model_path, preset, dtype, quantize, kv_cache_gb, max_num_seqs, max_num_batched_tokens,
            decode_steps, page_size, json_path, record, profile, mesh, batch, input_len,
            output_len, repeats):
    """Time to first token and per-token decode time."""
    _check_model_args(model_path, preset, quantize)
    ceilings = ceilings_in_child_process()
    llm = _load(model_path, preset, dtype, kv_cache_gb, max_num_seqs, max_num_batched_tokens,
                decode_steps, page_size, mesh, quantize)
    with _profiled(profile):
        r, rows = bench_latency(llm, input_len, output_len, batch, ceilings, repeats=repeats)
    headline = (f"TTFT {r['ttft_ms']:.1f} ms · per-token {r['itl_ms']:.2f} ms · "
                f"{r['tokens_per_s']:.1f} tokens/s (batch {batch}, in {input_len}, "
                f"out {output_len}, weights {r['weight_bytes'] / 1e9:.2f} GB, "
                f"{r['step_weight_bytes'] / 1e9:.2f} GB read per step)")
    _report("latency", ceilings, rows, headline, r, json_path, record)


@bench.command()
@_model_options
@click.option("--num-requests", type=int, default=64, show_default=True)
@click.option("--input-len", type=int, default=256, show_default=True)
@click.option("--output-len", type=int, default=128, show_default=True)
def throughput(model_path, preset, dtype, quantize, kv_cache_gb, max_num_seqs,
               max_num_batched_tokens, decode_steps, page_size, json_path, record, profile,
               mesh, num_requests, input_len, output_len):
    """Offline throughput: N requests at once; output tokens/s."""
    _check_model_args(model_path, preset, quantize)
    ceilings = ceilings_in_child_process()
    llm = _load(model_path, preset, dtype, kv_cache_gb, max_num_seqs, max_num_batched_tokens,
                decode_steps, page_size, mesh, quantize)
    with _profiled(profile):
        r, rows = bench_throughput(llm, num_requests, input_len, output_len, ceilings)
    decode, roof = r["decode_tokens_per_s"], r["decode_roofline_tokens_per_s"]
    headline = (f"{r['num_requests']} requests (in <= {input_len}, out {output_len}): "
                f"{r['output_tokens_per_s']:.1f} output tokens/s, "
                f"{r['requests_per_s']:.2f} requests/s, {r['seconds']:.1f} s; decode-only "
                f"steps {decode:.1f} tokens/s = {100 * decode / max(roof, 1e-9):.1f}% of their "
                f"roofline ({roof:.0f} tokens/s)")
    _report("throughput", ceilings, rows, headline, r, json_path, record)


def _plot(rows, ceilings, path):
    try:  # matplotlib: optional, for --plot only
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise JaxinferError("--plot needs matplotlib (pip install matplotlib)") from None
    intensity = [r["flops"] / r["bytes"] for r in rows]
    achieved = [r["flops"] / (r["time_us"] * 1e-6) for r in rows]
    ridge = ceilings.matmul_flops_per_s / ceilings.copy_bytes_per_s  # where the roofs meet
    xs = [min(intensity) / 2, ridge, max(max(intensity), ridge) * 2]
    fig, ax = plt.subplots(figsize=(7, 5))
    ax.loglog(xs, [min(x * ceilings.copy_bytes_per_s, ceilings.matmul_flops_per_s) for x in xs],
              "k-", label="roofline (measured ceilings)")
    for r, x, y in zip(rows, intensity, achieved, strict=True):
        ax.loglog([x], [y], "o", label=r["name"])
    ax.set_xlabel("FLOP / byte")
    ax.set_ylabel("FLOP/s")
    ax.legend(fontsize=6)
    fig.savefig(path, dpi=120)


@bench.command()
@click.option("--url", default=None,
              help="A running server (e.g. http://127.0.0.1:8000); default: start one on "
                   "loopback with the model options below and stop it after.")
@click.option("--model", "model_path", default=None, help="Checkpoint for the started server.")
@click.option("--preset", default=None, help="Random-weight shape for the started server.")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16",
              show_default=True)
@click.option("--kv-cache-gb", type=float, default=4.0, show_default=True)
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=2048,
              show_default=True)
@click.option("--max-model-len", type=click.IntRange(min=2), default=None)
@click.option("--decode-steps", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--page-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--api-key", default=None)
@click.option("--mesh", default=None, metavar="SPEC", help="--mesh of the started server.")
@click.option("--server-warmup/--no-server-warmup", default=True, show_default=True,
              help="Let the started server compile its buckets before it is ready.")
@click.option("--num-requests", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--concurrency", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--input-len", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--output-len", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--range-ratio", type=click.FloatRange(0, 1, max_open=True), default=0.0,
              show_default=True, help="Prompt lengths uniform in [len * (1 - r), len].")
@click.option("--warmup-passes", type=click.IntRange(min=0), default=1, show_default=True,
              help="Unmeasured passes first, with other prompts of the same lengths, so that "
                   "the measured one compiles nothing.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_path", default=None)
@click.option("--record", default=None)
def serve(url, model_path, preset, dtype, kv_cache_gb, max_num_seqs, max_num_batched_tokens,
          max_model_len, decode_steps, page_size, api_key, mesh, server_warmup, num_requests,
          concurrency, input_len, output_len, range_ratio, warmup_passes, seed, json_path,
          record):
    """Load-test the OpenAI-compatible server: throughput, TTFT and ITL percentiles."""
    # The load generator needs httpx, of the optional `serve` extra.
    from jaxinfer.benchmarks.serve_load import (
        decode_roofline,
        format_summary,
        random_prompts,
        run_load,
    )
    server, ceilings = None, None
    if url is None:
        if bool(preset) == bool(model_path):
            raise JaxinferError("give --url, or one of --model / --preset to start a server")
        ceilings = ceilings_in_child_process()  # before the server takes the device's memory
        args = ["--dtype", dtype, "--kv-cache-gb", str(kv_cache_gb), "--max-num-seqs",
                str(max_num_seqs), "--max-num-batched-tokens", str(max_num_batched_tokens),
                "--decode-steps", str(decode_steps), "--page-size", str(page_size)]
        args += ["--preset", preset] if preset else ["--model", model_path]
        if max_model_len:
            args += ["--max-model-len", str(max_model_len)]
        if api_key:
            args += ["--api-key", api_key]
        if mesh:
            args += ["--mesh", mesh]
        if not server_warmup:
            args.append("--no-warmup")
        server, url = _start_server(args)
    try:
        info = _server_info(url, api_key)
        for i in range(warmup_passes):
            click.echo(f"warm-up pass {i + 1} of {warmup_passes}", err=True)
            run_load(url, info["model"], random_prompts(num_requests, input_len, range_ratio,
                                                        info["vocab_size"], seed + 1 + i),
                     output_len, concurrency, api_key)
        prompts = random_prompts(num_requests, input_len, range_ratio, info["vocab_size"], seed)
        summary = run_load(url, info["model"], prompts, output_len, concurrency, api_key)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    rows = []
    if ceilings is not None:
        reads = StepReads.from_info(info)
        summary.update(decode_roofline(summary, reads, info["kv_bytes_per_token"],
                                       ceilings.copy_bytes_per_s))
        # The mean decode step, as if every step gave each of the concurrent requests a token.
        c = concurrency
        ctx = summary["mean_input_len"] + output_len / 2
        rows.append(roofline(f"decode step, {c} concurrent (ctx ~{ctx:.0f})",
                             c / summary["output_tokens_per_s"],
                             reads.step_bytes(c) + c * ctx * info["kv_bytes_per_token"],
                             2 * info["active_weight_count"] * c, ceilings))
    _report("serve", ceilings or Ceilings(float("nan"), float("nan")), rows,
            format_summary(summary), summary, json_path, record)


def _start_server(args: list[str]):
    """Starts `jaxinfer serve` on a free loopback port; returns (process, url) once /health
    answers. The server's output goes to stderr."""
    import httpx  # the optional `serve` extra

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "jaxinfer.cli.main", "serve", "--port",
                             str(port), *args], stdout=sys.__stderr__)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise JaxinferError(f"the server exited with status {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        time.sleep(0.5)
    proc.terminate()
    raise JaxinferError("the server did not become ready in 30 minutes")


def _server_info(url: str, api_key: str | None) -> dict:
    """The served model's name (/v1/models) and its sizes (the jaxinfer_model_* gauges of
    /metrics)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    models = httpx.get(url + "/v1/models", headers=headers, timeout=10).json()
    info = {"model": models["data"][0]["id"]}
    text = httpx.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name.startswith("jaxinfer_model_"):
            info[family.name[len("jaxinfer_model_"):]] = family.samples[0].value
    info["vocab_size"] = int(info["vocab_size"])
    return info
