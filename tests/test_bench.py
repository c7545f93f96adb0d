"""`jaxinfer bench` on CPU with a tiny random preset: checks the report's fields, not the speed."""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time

import click
import jax.numpy as jnp
import pytest
from click.testing import CliRunner

from jaxinfer.benchmarks.serve_load import soak_roles
from jaxinfer.cli.main import cli
from jaxinfer.loading.presets import preset_config, random_model
from jaxinfer.loading.weights import (
    StepReads,
    active_weight_count,
    step_reads,
    step_weight_bytes,
    weight_bytes,
    weight_count,
)

ROW_FIELDS = {"name", "time_us", "bytes", "flops", "pct_copy_bw", "pct_matmul", "floor_us",
              "pct_of_floor"}


def _run(args, tmp_path):
    out = tmp_path / "result.json"
    record = tmp_path / "RESULTS.md"
    result = CliRunner().invoke(cli, ["bench", *args, "--json", str(out), "--record", str(record)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert {"date", "device", "jax", "command"} <= set(data)
    assert data["command"].startswith("jaxinfer ")
    assert "| what | time (us) |" in result.output and "ceilings: copy" in result.output
    assert record.read_text().count("| what | time (us) |") == 1
    return data


def _check_rows(data):
    """The report's arithmetic against its own ceilings, not the machine's speed: on CPU,
    with another test worker beside it, a row can run faster than the ceilings measured a
    moment earlier (one did, at 152% of its floor)."""
    copy, matmul = (data["ceilings"][n] for n in ("copy_bytes_per_s", "matmul_flops_per_s"))
    assert copy > 0 and matmul > 0 and data["rows"]
    for r in data["rows"]:
        assert set(r) == ROW_FIELDS
        assert r["time_us"] > 0 and r["bytes"] > 0 and r["flops"] > 0
        seconds = r["time_us"] * 1e-6
        assert r["pct_copy_bw"] == pytest.approx(100 * r["bytes"] / seconds / copy)
        assert r["pct_matmul"] == pytest.approx(100 * r["flops"] / seconds / matmul)
        assert r["pct_of_floor"] == pytest.approx(100 * r["floor_us"] / r["time_us"])
        # The slower ceiling's time, or a sum of per-step floors, which is no less.
        assert r["floor_us"] >= max(r["bytes"] / copy, r["flops"] / matmul) * 1e6 * (1 - 1e-9)


def test_bench_kernels_reference(tmp_path):
    data = _run(["kernels", "--backend", "reference", "--small"], tmp_path)
    _check_rows(data)
    assert any(r["name"].startswith("attention") for r in data["rows"])


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_bench_latency_tiny(tmp_path, preset):
    data = _run(["latency", "--preset", preset, "--input-len", "20", "--output-len", "6",
                 "--kv-cache-gb", "0.01", "--repeats", "3"], tmp_path)
    assert data["ttft_ms"] > 0 and data["itl_ms"] > 0 and data["tokens_per_s"] > 0
    runs = data["itl_ms_runs"]  # the headline is the median of the timed runs
    assert len(runs) == 3 and data["itl_ms"] == pytest.approx(sorted(runs)[1])
    _check_rows(data)
    # The floor's bytes, bf16: one embedding row, the experts one token hits, the K/V.
    config = preset_config(preset)
    table, others, experts = hand_count(config)
    k_of_e = config.num_experts_per_tok / config.num_experts if config.is_moe else 0
    assert data["weight_bytes"] == 2 * (table + others + experts)
    assert data["step_weight_bytes"] == pytest.approx(
        2 * (others + config.hidden_size + k_of_e * experts), abs=1)
    kv = (20 + 6 // 2) * config.kv_bytes_per_token(2)
    assert data["rows"][0]["bytes"] == pytest.approx(data["step_weight_bytes"] + kv)


def test_bench_latency_times_no_compile(monkeypatch):
    """`bench_latency`'s timed runs compile nothing, without the serving warm-up (the CLI
    skips it when the KV cache's size is given): its untimed first run compiles what they
    take and waits for the next page bucket's program, which it starts in the background
    (1040 tokens of context: past half of the smallest page bucket, WARMUP_CONTEXT's)."""
    from jaxinfer import LLM
    from jaxinfer.benchmarks.end_to_end import bench_latency
    from jaxinfer.benchmarks.harness import Ceilings
    from jaxinfer.engine.compiled_steps import CompiledSteps

    config = dataclasses.replace(preset_config("tiny"), max_position_embeddings=4096)
    llm = LLM(random_model(config, jnp.float32), kv_cache_bytes=1 << 23)
    builds, batches = [], []
    build, add_request = CompiledSteps._build, llm.engine.add_request

    def counted_build(self, shape):
        program = build(self, shape)
        if threading.current_thread() is not threading.main_thread():
            time.sleep(2.0)  # a background compile slower than the rest of the first run
        builds.append((len(batches), shape))  # (the run it finished in, 1 = the first)
        return program

    def counted_add(*args, **kwargs):
        batches.append(1)
        return add_request(*args, **kwargs)

    monkeypatch.setattr(CompiledSteps, "_build", counted_build)
    monkeypatch.setattr(llm.engine, "add_request", counted_add)
    r, _ = bench_latency(llm, 1030, 10, 1, Ceilings(1e11, 1e12), repeats=2)
    assert len(batches) == 3 and r["itl_ms"] > 0
    assert builds and all(run == 1 for run, _ in builds), builds
    assert len({shape.pages_per_seq for _, shape in builds}) >= 2  # the prefetch among them


def hand_count(c) -> tuple[int, int, int]:
    """(input embedding table, every other weight but the experts (an untied LM head's own
    table included), expert weights), counted from the config."""
    q, kv, h = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size
    attention = h * (q + 2 * kv) + q * h + (2 * c.head_dim if c.qk_norm else 0)
    if c.is_moe:  # a router, and E experts of gate, up and down
        mlp, experts = c.num_experts * h, c.num_experts * 3 * h * c.moe_intermediate_size
    else:
        mlp, experts = 3 * h * c.intermediate_size, 0
    table = c.vocab_size * h
    others = (c.num_layers * (attention + mlp + 2 * h) + h  # + the layers' and final norms
              + (0 if c.tie_word_embeddings else table))  # the LM head's own table
    return table, others, c.num_layers * experts


@pytest.mark.parametrize("tied", [False, True])
def test_weight_counts_dense(tied):
    """An untied input embedding is read one row per token and multiplies nothing; a tied
    table is read whole (the LM head) and counted once."""
    config = dataclasses.replace(preset_config("tiny"), tie_word_embeddings=tied)
    dtype = jnp.bfloat16 if tied else jnp.float32
    size = jnp.dtype(dtype).itemsize
    model = random_model(config, dtype=dtype)
    table, others, experts = hand_count(config)
    assert experts == 0 and (model.lm_head is None) == tied
    assert weight_count(model) == others + table
    assert weight_bytes(model) == size * (others + table)
    row = config.hidden_size
    for tokens in (1, 7):
        read = others + (table if tied else tokens * row)
        assert step_weight_bytes(model, tokens) == size * read
    assert active_weight_count(model) == others + (table if tied else 0)
    reads = step_reads(model)
    assert reads.embedding_row_bytes == (0 if tied else size * row)
    assert StepReads.from_info({**reads.as_info(), "vocab_size": 1.0}) == reads


def test_weight_counts_moe():
    """A MoE step reads the experts its tokens hit (uniform routing), one embedding row per
    token, every other weight once; a token multiplies k of E experts."""
    config = preset_config("tiny-moe")  # 8 experts, top 2
    model = random_model(config, dtype=jnp.float32)
    table, others, experts = hand_count(config)
    k_of_e = config.num_experts_per_tok / config.num_experts
    assert weight_count(model) == others + table + experts
    assert weight_bytes(model) == 4 * (others + table + experts)
    for tokens in (1, 3, 1000):
        hit = 1 - (1 - k_of_e) ** tokens
        assert step_weight_bytes(model, tokens) == pytest.approx(
            4 * (others + min(tokens, config.vocab_size) * config.hidden_size + hit * experts),
            abs=1)
    assert active_weight_count(model) == pytest.approx(others + k_of_e * experts, abs=1)
    # int4 projections: values at half a byte; scales read but not counted as weights.
    int4 = random_model(config, dtype=jnp.float32, quantize="int4")
    assert weight_count(int4) == weight_count(model)
    assert experts // 2 < step_reads(int4).expert_bytes < experts


def test_bench_throughput_tiny(tmp_path):
    data = _run(["throughput", "--preset", "tiny", "--num-requests", "6", "--input-len", "12",
                 "--output-len", "4", "--kv-cache-gb", "0.01", "--decode-steps", "2",
                 "--page-size", "8", "--temperature", "0.7", "--profile",
                 str(tmp_path / "trace")], tmp_path)
    assert data["num_requests"] == 6 and data["output_tokens_per_s"] > 0 and data["steps"] > 0
    assert data["page_size"] == 8 and (data["temperature"], data["top_p"]) == (0.7, 1.0)
    assert data["gc_collections"] >= data["gc_full_collections"] >= 0 <= data["gc_seconds"]
    # Every output token counted once; after the prefills, decode-only steps of 2 iterations.
    assert data["output_tokens"] == 6 * 4 and 0 < data["decode_tokens"] < 6 * 4
    # Every prompt token runs once (no prefix hits: fresh prompts), then every output token
    # but the last is fed back.
    assert data["tokens_run"] == data["prompt_tokens"] + 6 * (4 - 1)
    assert 0 < data["decode_steps_run"] < data["steps"] and data["decode_tokens_per_s"] > 0
    assert data["floor_seconds"] < data["seconds"]
    assert [r["name"].split(" (")[0] for r in data["rows"]] == [
        "whole run", "decode-only steps", "steps with a prompt chunk"]
    # The steps split into the two kinds; their times add up to within the run's wall time.
    assert data["decode_steps_run"] + data["prompt_steps_run"] == data["steps"]
    assert 0 < data["decode_steps_seconds"] + data["prompt_steps_seconds"] <= data["seconds"]
    assert 0 < data["prompt_steps_floor_seconds"] < data["floor_seconds"]
    _check_rows(data)
    assert list((tmp_path / "trace").rglob("*.xplane.pb"))  # the jax.profiler trace


def test_bench_kernels_plot(tmp_path):
    png = tmp_path / "roofline.png"
    result = CliRunner().invoke(cli, ["bench", "kernels", "--small", "--plot", str(png)])
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {png}" in result.output


@pytest.mark.parametrize("case", ["no matplotlib", "no folder"])
def test_bench_kernels_output_errors_come_first(tmp_path, monkeypatch, case):
    """A --plot that cannot be drawn, or an output in a missing folder, fails in one line
    before anything is measured."""
    import jaxinfer.cli.bench as bench_cli

    measured = []
    monkeypatch.setattr(bench_cli, "measure_ceilings", lambda: measured.append(1))
    args = ["bench", "kernels", "--small", "--plot", str(tmp_path / "roofline.png")]
    if case == "no matplotlib":
        monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
        says = "--plot needs matplotlib"
    else:
        args += ["--json", str(tmp_path / "missing" / "result.json")]
        says = f"--json {tmp_path / 'missing' / 'result.json'}: no folder"
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1 and not measured, result.output
    assert result.output.strip().splitlines() == [result.output.strip()]
    assert says in result.output


def test_every_bench_option_has_help():
    from jaxinfer.cli.bench import bench

    assert set(bench.commands) == {"kernels", "latency", "throughput", "serve"}
    missing = [f"{name} {opt.opts[0]}" for name, command in bench.commands.items()
               for opt in command.params if isinstance(opt, click.Option) and not opt.help]
    assert not missing, missing


def test_bench_serve_soak(tmp_path):
    """A CI-sized soak against a real server process in bf16 and batch-invariant mode:
    clients that leave mid-stream (the server aborts their requests) and malformed requests
    (each must get a 4xx), then nothing left on the server (requests, KV pages), and
    completed greedy requests sent again alone give the same tokens."""
    data = _run(["serve", "--preset", "tiny", "--dtype", "bfloat16", "--batch-invariant",
                 "--num-requests", "60",
                 "--concurrency", "16", "--input-len", "24", "--range-ratio", "0.5",
                 "--output-len", "48", "--kv-cache-gb", "0.01", "--max-num-seqs", "8",
                 "--max-num-batched-tokens", "64", "--page-size", "8", "--no-server-warmup",
                 "--warmup-passes", "0", "--disconnect-fraction", "0.1",
                 "--malformed-fraction", "0.05", "--check-solo", "10"], tmp_path)
    assert (data["num_requests"], data["num_disconnected"], data["num_malformed"]) == (60, 6, 3)
    assert data["requests_left"] == 0 and data["kv_pages_left"] == 0
    # A disconnect is noticed at the stream's next write, so one whose last tokens were
    # already on their way may finish first; most are aborted.
    assert 3 <= data["requests_aborted"] <= 6
    assert data["solo_compared"] == 10 and data["solo_mismatches"] == 0


def test_soak_roles_and_malformed_requests_are_counted():
    roles = soak_roles(200, 0.1, 0.05, seed=3)
    assert (roles.count("disconnect"), roles.count("malformed")) == (20, 10)
    assert roles == soak_roles(200, 0.1, 0.05, seed=3) != soak_roles(200, 0.1, 0.05, seed=4)


def test_bench_rejects_model_and_preset(tmp_path):
    result = CliRunner().invoke(cli, ["bench", "latency", "--preset", "tiny", "--model", "x"])
    assert result.exit_code == 1 and "not both" in result.output


def test_bench_serve_tiny(tmp_path):
    """The load generator against a real `jaxinfer serve` process on loopback, started with
    fp8 KV pages (one byte a K/V element in the roofline's bytes)."""
    data = _run(["serve", "--preset", "tiny", "--dtype", "float32", "--num-requests", "6",
                 "--concurrency", "3", "--input-len", "20", "--output-len", "8",
                 "--kv-cache-gb", "0.01", "--max-num-seqs", "4", "--max-num-batched-tokens",
                 "64", "--decode-steps", "4", "--page-size", "8", "--no-server-warmup",
                 "--warmup-passes", "0", "--kv-cache-dtype", "fp8"],
                tmp_path)
    assert data["num_requests"] == 6 and data["output_tokens_per_s"] > 0
    for key in ("ttft_ms", "itl_ms", "latency_ms"):
        p = data[key]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"], (key, p)
    assert 0 < data["fraction_of_roofline"] and data["roofline_output_tokens_per_s"] > 0
    # The decode row's bytes, from the server's published sizes: float32 weights read by a
    # step of 3 tokens (3 embedding rows) and 3 sequences' fp8 K/V at the mean context.
    config = preset_config("tiny")
    _, others, _ = hand_count(config)
    ctx = data["mean_input_len"] + 8 / 2
    (row,) = data["rows"]
    assert row["bytes"] == pytest.approx(4 * (others + 3 * config.hidden_size)
                                         + 3 * ctx * config.kv_bytes_per_token(1))
