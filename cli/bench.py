"""`jaxinfer bench kernels | latency | throughput`: thin commands over `jaxinfer.bench`.

Each prints a roofline table (ceilings measured in the same run) and can write the
result as JSON (`--json`) and append a row to a results file (`--record bench/RESULTS.md`).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import shlex
import sys

import click


@click.group()
def bench():
    """Benchmarks with a roofline report."""


def _model_options(fn):
    opts = [
        click.option("--model", "model_path", default=None,
                     help="Checkpoint (converted dir, HF dir, .gguf); default: --preset."),
        click.option("--preset", default=None,
                     help="Random-weight model shape (llama3-8b, llama3-70b, qwen3-8b, tiny)."),
        click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16",
                     show_default=True),
        click.option("--kv-cache-gb", type=float, default=4.0, show_default=True),
        click.option("--max-num-seqs", type=click.IntRange(min=1), default=64,
                     show_default=True),
        click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=2048,
                     show_default=True),
        click.option("--json", "json_path", default=None, help="Write the result as JSON."),
        click.option("--record", default=None, help="Append a row to this markdown file."),
        click.option("--profile", default=None, help="Write a jax.profiler trace to this dir."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def _load(model_path, preset, dtype, kv_cache_gb, max_num_seqs, max_num_batched_tokens):
    import jax.numpy as jnp

    from jaxinfer import LLM
    from jaxinfer.errors import JaxinferError
    from jaxinfer.presets import preset_config, random_model

    if preset and model_path:
        raise JaxinferError("give --model or --preset, not both")
    model = random_model(preset_config(preset), getattr(jnp, dtype)) if preset else model_path
    return LLM(model, dtype=None if preset else dtype, kv_cache_bytes=int(kv_cache_gb * 2**30),
               max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)


def _report(kind, ceilings, rows, headline, result, json_path, record):
    """Prints the ceilings, the headline and the roofline rows; writes JSON / a results row."""
    import jax

    from jaxinfer.bench import format_rows

    device = jax.devices()[0].device_kind
    command = "jaxinfer " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    table = "\n\n".join(x for x in (ceilings.line(), headline, format_rows(rows)) if x)
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
    import jax

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
    from jaxinfer.bench import bench_kernels, measure_ceilings

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
def latency(model_path, preset, dtype, kv_cache_gb, max_num_seqs, max_num_batched_tokens,
            json_path, record, profile, batch, input_len, output_len):
    """Time to first token and per-token decode time."""
    from jaxinfer.bench import bench_latency, measure_ceilings

    llm = _load(model_path, preset, dtype, kv_cache_gb, max_num_seqs, max_num_batched_tokens)
    ceilings = measure_ceilings()
    with _profiled(profile):
        r, rows = bench_latency(llm, input_len, output_len, batch, ceilings)
    headline = (f"TTFT {r['ttft_ms']:.1f} ms · per-token {r['itl_ms']:.2f} ms · "
                f"{r['tokens_per_s']:.1f} tokens/s (batch {batch}, in {input_len}, "
                f"out {output_len}, weights {r['weight_bytes'] / 1e9:.2f} GB)")
    _report("latency", ceilings, rows, headline, r, json_path, record)


@bench.command()
@_model_options
@click.option("--num-requests", type=int, default=64, show_default=True)
@click.option("--input-len", type=int, default=256, show_default=True)
@click.option("--output-len", type=int, default=128, show_default=True)
def throughput(model_path, preset, dtype, kv_cache_gb, max_num_seqs, max_num_batched_tokens,
               json_path, record, profile, num_requests, input_len, output_len):
    """Offline throughput: N requests at once; output tokens/s."""
    from jaxinfer.bench import bench_throughput, measure_ceilings

    llm = _load(model_path, preset, dtype, kv_cache_gb, max_num_seqs, max_num_batched_tokens)
    ceilings = measure_ceilings()
    with _profiled(profile):
        r, rows = bench_throughput(llm, num_requests, input_len, output_len, ceilings)
    headline = (f"{r['num_requests']} requests (in <= {input_len}, out {output_len}): "
                f"{r['output_tokens_per_s']:.1f} output tokens/s, "
                f"{r['requests_per_s']:.2f} requests/s, {r['seconds']:.1f} s")
    _report("throughput", ceilings, rows, headline, r, json_path, record)


def _plot(rows, ceilings, path):
    from jaxinfer.errors import JaxinferError

    try:
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
