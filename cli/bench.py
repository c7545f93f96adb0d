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
from pathlib import Path

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
from jaxinfer.cli.parallel import (
    batch_invariant_option,
    kv_cache_dtype_option,
    memory_utilization_option,
    random_or_path,
)
from jaxinfer.engine.defaults import describe
from jaxinfer.errors import JaxinferError
from jaxinfer.loading.plan import set_memory_utilization
from jaxinfer.loading.weights import StepReads
from jaxinfer.ops.quant import parse_format


@click.group()
def bench():
    """Benchmarks with a roofline report."""


# Options several commands share (each use makes its own click.Option).
_json_option = click.option(
    "--json", "json_path", default=None, metavar="FILE",
    help="Also write the result (ceilings, rows, device, command) to FILE as JSON.")
_record_option = click.option(
    "--record", default=None, metavar="FILE",
    help="Append the report to FILE as a markdown section (e.g. bench/RESULTS.md).")
_profile_option = click.option(
    "--profile", default=None, metavar="DIR",
    help="Write a jax.profiler trace of the timed part to DIR (TensorBoard / Perfetto).")
_dtype_option = click.option(
    "--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16",
    show_default=True, help="dtype of the weights and the computation.")
_kv_cache_option = click.option(
    "--kv-cache-gb", type=click.FloatRange(min=0, min_open=True), default=None,
    help="Size of the paged KV cache in GiB (default: planned, as `jaxinfer serve` does: "
         "see --gpu-memory-utilization).")
_max_num_seqs_option = click.option(
    "--max-num-seqs", type=click.IntRange(min=1), default=None,
    help=f"Most sequences the engine runs in one step ({describe('max_num_seqs')}).")
_max_num_batched_tokens_option = click.option(
    "--max-num-batched-tokens", type=click.IntRange(min=1), default=None,
    help="Most tokens (prompt chunks and decodes) in one engine step "
         f"({describe('max_num_batched_tokens')}).")
_decode_steps_option = click.option(
    "--decode-steps", type=click.IntRange(min=1), default=None,
    help=f"Decode steps per host round trip, when every request decodes "
         f"({describe('decode_steps')}).")
_page_size_option = click.option(
    "--page-size", type=click.IntRange(min=1), default=16, show_default=True,
    help="Tokens per KV-cache page.")


def _model_options(fn):
    opts = [
        click.option("--model", "model_path", default=None,
                     help="Checkpoint (converted dir, HF dir, .gguf); default: --preset."),
        click.option("--preset", default=None,
                     help="Random-weight model shape (llama3-8b, llama3-70b, qwen3-8b, "
                          "qwen3-30b-a3b, mixtral-8x7b, gpt-oss-20b, tiny, tiny-moe)."),
        _dtype_option,
        click.option("--quantize", default=None, metavar="FORMAT",
                     help="With --preset: quantize the random projections to FORMAT (int8, "
                          "int4:g128, fp8, ...), as `jaxinfer convert --quantize` would."),
        _kv_cache_option,
        memory_utilization_option,
        kv_cache_dtype_option,
        batch_invariant_option,
        _max_num_seqs_option,
        _max_num_batched_tokens_option,
        _decode_steps_option,
        _page_size_option,
        _json_option,
        _record_option,
        _profile_option,
        click.option("--mesh", default=None, metavar="SPEC",
                     help="Split the model over devices, e.g. tp=2 (see `jaxinfer serve`)."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def _check_outputs(**paths):
    """Each output file's folder exists (checked before anything is measured); keywords are
    the options' names (json="x.json")."""
    for option, path in paths.items():
        folder = Path(path).absolute().parent if path else None
        if folder is not None and not folder.is_dir():
            raise JaxinferError(f"--{option} {path}: no folder {folder}")


def _check_model_args(model_path, preset, quantize):
    """The model options' own errors, before anything is measured or loaded."""
    if preset and model_path:
        raise JaxinferError("give --model or --preset, not both")
    if quantize and not preset:
        raise JaxinferError("--quantize goes with --preset; quantize a checkpoint with "
                            "`jaxinfer convert --quantize`")
    if quantize:
        parse_format(quantize)


def _load(model_path, preset, dtype, kv_cache_gb, gpu_memory_utilization, kv_cache_dtype,
          max_num_seqs, max_num_batched_tokens, decode_steps, page_size, mesh=None,
          quantize=None, batch_invariant=False, warmup=True):
    """The LLM the options describe; warmup: its serving programs compiled first, as a
    server's are (`LLM.warmup`)."""
    _check_model_args(model_path, preset, quantize)
    set_memory_utilization(gpu_memory_utilization)  # before JAX starts
    model = random_or_path(model_path, preset, dtype, mesh, quantize)
    llm = LLM(model, dtype=None if preset else dtype,
              kv_cache_bytes=None if kv_cache_gb is None else int(kv_cache_gb * 2**30),
              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
              decode_steps=decode_steps, page_size=page_size, mesh=mesh,
              gpu_memory_utilization=gpu_memory_utilization, kv_cache_dtype=kv_cache_dtype,
              start_warmup=warmup, batch_invariant=batch_invariant)
    if llm.kv_plan is not None:
        click.echo(llm.kv_plan.format(page_size), err=True)
    if warmup:
        # As a server does: its programs compile (XLA autotuning their GEMMs) before the KV
        # cache takes the memory planned for it, and no measured step waits for a compile.
        llm.warmup()
    return llm


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
        click.echo(f"wrote {json_path}")
    if record:
        with open(record, "a") as f:
            f.write(f"\n### {full['date']} · {device} · jax {jax.__version__} · bench {kind}\n\n"
                    f"`{command}`\n\n{table}\n")
        click.echo(f"appended the report to {record}")


def _profiled(profile_dir):
    return jax.profiler.trace(profile_dir) if profile_dir else contextlib.nullcontext()


@bench.command()
@click.option("--backend", type=click.Choice(["reference"]), default="reference",
              show_default=True,
              help="Kernel implementations to time (only the reference ones so far).")
@click.option("--small", is_flag=True, help="Small shapes (CPU smoke runs).")
@_json_option
@_record_option
@_profile_option
@click.option("--plot", default=None, metavar="PNG",
              help="Also draw the rows on the roofline into this PNG file (needs matplotlib).")
def kernels(backend, small, json_path, record, profile, plot):
    """Attention and linear kernels against the device ceilings measured in the same run."""
    _check_outputs(json=json_path, record=record, plot=plot)
    pyplot = _pyplot() if plot else None  # a missing matplotlib fails before the long part
    with _profiled(profile):
        ceilings = measure_ceilings()
        rows = bench_kernels(ceilings, backend, small=small)
    _report("kernels", ceilings, rows, None, {}, json_path, record)
    if plot:
        _plot(pyplot, rows, ceilings, plot)
        click.echo(f"wrote {plot}")


@bench.command()
@_model_options
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True,
              help="Prompts sent at once, decoded together.")
@click.option("--input-len", type=click.IntRange(min=1), default=128, show_default=True,
              help="Tokens per prompt (random token ids).")
@click.option("--output-len", type=click.IntRange(min=1), default=128, show_default=True,
              help="Tokens generated per prompt (EOS ignored).")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Timed runs after the compiling one; the report gives their medians.")
def latency(model_path, preset, dtype, quantize, kv_cache_gb, gpu_memory_utilization,
            kv_cache_dtype, batch_invariant, max_num_seqs, max_num_batched_tokens,
            decode_steps, page_size, json_path, record, profile, mesh, batch, input_len,
            output_len, repeats):
    """Time to first token and per-token decode time."""
    _check_model_args(model_path, preset, quantize)
    _check_outputs(json=json_path, record=record)
    ceilings = ceilings_in_child_process()
    # With the KV cache's size given, no plan waits for the serving programs: the untimed
    # first run compiles the few this run takes, not the ~48 a server warms up (2.7 s each
    # at the start of one on a fresh H200, Qwen3-30B-A3B).
    llm = _load(model_path, preset, dtype, kv_cache_gb, gpu_memory_utilization, kv_cache_dtype,
                max_num_seqs, max_num_batched_tokens, decode_steps, page_size, mesh, quantize,
                batch_invariant, warmup=kv_cache_gb is None)
    with _profiled(profile):
        r, rows = bench_latency(llm, input_len, output_len, batch, ceilings, repeats=repeats)
    headline = (f"TTFT {r['ttft_ms']:.1f} ms · per-token {r['itl_ms']:.2f} ms · "
                f"{r['tokens_per_s']:.1f} tokens/s (batch {batch}, in {input_len}, "
                f"out {output_len}, weights {r['weight_bytes'] / 1e9:.2f} GB, "
                f"{r['step_weight_bytes'] / 1e9:.2f} GB read per step)")
    _report("latency", ceilings, rows, headline, r, json_path, record)


@bench.command()
@_model_options
@click.option("--num-requests", type=click.IntRange(min=1), default=64, show_default=True,
              help="Requests, all submitted at the start.")
@click.option("--input-len", type=click.IntRange(min=1), default=256, show_default=True,
              help="Longest prompt: lengths are uniform in [len / 2, len] (random token ids).")
@click.option("--output-len", type=click.IntRange(min=1), default=128, show_default=True,
              help="Tokens generated per request (EOS ignored).")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Sampling temperature of every request (0: greedy; vLLM's throughput "
                   "benchmark samples at 1.0).")
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=1.0,
              show_default=True, help="top_p of every request (1: no filter).")
def throughput(model_path, preset, dtype, quantize, kv_cache_gb, gpu_memory_utilization,
               kv_cache_dtype, batch_invariant, max_num_seqs, max_num_batched_tokens,
               decode_steps, page_size, json_path, record, profile, mesh, num_requests,
               input_len, output_len, temperature, top_p):
    """Offline throughput: N requests at once; output tokens/s."""
    _check_model_args(model_path, preset, quantize)
    _check_outputs(json=json_path, record=record)
    ceilings = ceilings_in_child_process()
    llm = _load(model_path, preset, dtype, kv_cache_gb, gpu_memory_utilization, kv_cache_dtype,
                max_num_seqs, max_num_batched_tokens, decode_steps, page_size, mesh, quantize,
                batch_invariant)
    with _profiled(profile):
        r, rows = bench_throughput(llm, num_requests, input_len, output_len, ceilings,
                                   temperature=temperature, top_p=top_p)
    decode, roof = r["decode_tokens_per_s"], r["decode_roofline_tokens_per_s"]
    sampled = f", temperature {temperature}, top_p {top_p}" if temperature > 0 else ""
    headline = (f"{r['num_requests']} requests (in <= {input_len}, out {output_len}{sampled}): "
                f"{r['output_tokens_per_s']:.1f} output tokens/s, "
                f"{r['requests_per_s']:.2f} requests/s, {r['seconds']:.1f} s; decode-only "
                f"steps {decode:.1f} tokens/s = {100 * decode / max(roof, 1e-9):.1f}% of their "
                f"roofline ({roof:.0f} tokens/s); host garbage collection "
                f"{1e3 * r['gc_seconds']:.0f} ms ({r['gc_full_collections']} full)")
    _report("throughput", ceilings, rows, headline, r, json_path, record)


def _pyplot():
    """matplotlib.pyplot (optional: for --plot only), drawing to files."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise JaxinferError("--plot needs matplotlib (pip install matplotlib)") from None
    return plt


def _plot(plt, rows, ceilings, path):
    """Draws the rows (achieved FLOP/s against FLOP/byte) under the roofline into `path`."""
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
@_dtype_option
@_kv_cache_option
@kv_cache_dtype_option
@batch_invariant_option
@memory_utilization_option
@_max_num_seqs_option
@_max_num_batched_tokens_option
@click.option("--max-model-len", type=click.IntRange(min=2), default=None,
              help="The started server's longest prompt + output (default: the model's "
                   "context, capped by the cache).")
@_decode_steps_option
@_page_size_option
@click.option("--api-key", default=None,
              help="Sent as 'Authorization: Bearer KEY' (and required by the started server).")
@click.option("--mesh", default=None, metavar="SPEC", help="--mesh of the started server.")
@click.option("--server-warmup/--no-server-warmup", default=True, show_default=True,
              help="Let the started server compile its buckets before it is ready.")
@click.option("--num-requests", type=click.IntRange(min=1), default=64, show_default=True,
              help="Requests in the measured pass.")
@click.option("--concurrency", type=click.IntRange(min=1), default=64, show_default=True,
              help="Most requests in flight at once.")
@click.option("--input-len", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Longest prompt (random token ids; see --range-ratio).")
@click.option("--output-len", type=click.IntRange(min=1), default=256, show_default=True,
              help="Tokens generated per request (EOS ignored).")
@click.option("--range-ratio", type=click.FloatRange(0, 1, max_open=True), default=0.0,
              show_default=True, help="Prompt lengths uniform in [len * (1 - r), len].")
@click.option("--warmup-passes", type=click.IntRange(min=0), default=1, show_default=True,
              help="Unmeasured passes first, with other prompts of the same lengths, so that "
                   "the measured one compiles nothing.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the random prompts and their lengths.")
@click.option("--disconnect-fraction", type=click.FloatRange(0, 1), default=0.0,
              show_default=True,
              help="Soak: this share of the measured requests close their stream mid-way.")
@click.option("--malformed-fraction", type=click.FloatRange(0, 1), default=0.0,
              show_default=True,
              help="Soak: this share are malformed requests, each of which must get a 4xx.")
@click.option("--check-solo", type=click.IntRange(min=0), default=0, show_default=True,
              help="After the run, send this many completed requests again one at a time "
                   "and count those whose greedy tokens differ.")
@_json_option
@_record_option
def serve(url, model_path, preset, dtype, kv_cache_gb, kv_cache_dtype, batch_invariant,
          gpu_memory_utilization, max_num_seqs, max_num_batched_tokens, max_model_len,
          decode_steps, page_size, api_key, mesh, server_warmup, num_requests, concurrency,
          input_len, output_len, range_ratio, warmup_passes, seed, disconnect_fraction,
          malformed_fraction, check_solo, json_path, record):
    """Load-test the OpenAI-compatible server: throughput, TTFT and ITL percentiles. As a
    soak (--disconnect-fraction, --malformed-fraction): the server must answer every request
    and end with no request left and no KV page held, else the command fails."""
    # The load generator needs httpx, of the optional `serve` extra.
    from jaxinfer.benchmarks.serve_load import (
        decode_roofline,
        format_summary,
        random_prompts,
        run_load,
        soak_roles,
        solo_mismatches,
    )
    _check_outputs(json=json_path, record=record)
    server, ceilings = None, None
    if url is None:
        if bool(preset) == bool(model_path):
            raise JaxinferError("give --url, or one of --model / --preset to start a server")
        ceilings = ceilings_in_child_process()  # before the server takes the device's memory
        args = ["--dtype", dtype, "--gpu-memory-utilization", str(gpu_memory_utilization),
                "--page-size", str(page_size), "--kv-cache-dtype", kv_cache_dtype]
        for option, value in (("--max-num-seqs", max_num_seqs), ("--decode-steps", decode_steps),
                              ("--max-num-batched-tokens", max_num_batched_tokens)):
            if value is not None:  # else the server's default
                args += [option, str(value)]
        if kv_cache_gb is not None:
            args += ["--kv-cache-gb", str(kv_cache_gb)]
        if batch_invariant:
            args.append("--batch-invariant")
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
        roles = soak_roles(num_requests, disconnect_fraction, malformed_fraction, seed)
        results = []
        summary = run_load(url, info["model"], prompts, output_len, concurrency, api_key,
                           roles, seed, keep=results)
        summary.update(_server_left(url, server))
        if check_solo:
            summary.update(solo_mismatches(url, info["model"], prompts, results, output_len,
                                           check_solo, api_key))
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
    if summary["requests_left"] or summary["kv_pages_left"]:
        raise JaxinferError(f"after the load the server still holds "
                            f"{summary['requests_left']} requests and "
                            f"{summary['kv_pages_left']} KV pages")


def _server_left(url: str, server, wait_s: float = 30.0) -> dict:
    """What the server holds once the load is over (requests, KV pages in use: both 0 unless
    something leaked), waiting up to wait_s for it to let go of disconnected streams."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + wait_s
    while True:
        if server is not None and server.poll() is not None:
            raise JaxinferError(f"the server exited with status {server.returncode} "
                                "during the load")
        families = list(text_string_to_metric_families(
            httpx.get(url + "/metrics", timeout=10).text))
        values = {f.name: f.samples[0].value for f in families if f.samples}
        left = {"requests_left": int(values["jaxinfer_num_requests_running"]
                                     + values["jaxinfer_num_requests_waiting"]),
                "kv_pages_left": int(values["jaxinfer_kv_pages_in_use"])}
        if not any(left.values()) or time.monotonic() > deadline:
            # Requests the server ended because their client went away (all passes).
            left["requests_aborted"] = int(sum(
                x.value for f in families if f.name == "jaxinfer_requests"
                for x in f.samples if x.labels.get("finish_reason") == "abort"))
            return left
        time.sleep(0.2)


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
