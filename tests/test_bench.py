"""`jaxinfer bench` on CPU with a tiny random preset: checks the report's fields, not the speed."""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest
from click.testing import CliRunner

from jaxinfer.cli.main import cli

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


def test_moe_active_weights():
    """A batch-1 MoE step reads k of E experts: the roofline counts only those."""
    from jaxinfer.benchmarks.harness import expert_fraction, weight_bytes, weight_count
    from jaxinfer.loading.presets import preset_config, random_model

    config = preset_config("tiny-moe")  # 8 experts, top 2, float32 here
    model = random_model(config, dtype=jnp.float32)
    # Per layer, gate + up + down: 3 x [8 experts, 32, 64] float32 weights.
    experts = config.num_layers * 3 * 8 * 32 * 64 * 4
    total = weight_bytes(model)
    assert weight_bytes(model, tokens=1) == pytest.approx(total - experts * (1 - 2 / 8), abs=8)
    assert weight_count(model, active=True) == pytest.approx(
        weight_count(model) - experts / 4 * (1 - 2 / 8), abs=8)
    assert expert_fraction(config, 1000) == pytest.approx(1.0)


def test_bench_throughput_tiny(tmp_path):
    data = _run(["throughput", "--preset", "tiny", "--num-requests", "6", "--input-len", "12",
                 "--output-len", "4", "--kv-cache-gb", "0.01", "--decode-steps", "2",
                 "--page-size", "8", "--profile", str(tmp_path / "trace")], tmp_path)
    assert data["num_requests"] == 6 and data["output_tokens_per_s"] > 0 and data["steps"] > 0
    assert data["page_size"] == 8
    # Every output token counted once; after the prefills, decode-only steps of 2 iterations.
    assert data["output_tokens"] == 6 * 4 and 0 < data["decode_tokens"] < 6 * 4
    # Every prompt token runs once (no prefix hits: fresh prompts), then every output token
    # but the last is fed back.
    assert data["tokens_run"] == data["prompt_tokens"] + 6 * (4 - 1)
    assert 0 < data["decode_steps_run"] < data["steps"] and data["decode_tokens_per_s"] > 0
    assert data["floor_seconds"] < data["seconds"]
    assert [r["name"].split(" (")[0] for r in data["rows"]] == ["whole run", "decode-only steps"]
    _check_rows(data)
    assert list((tmp_path / "trace").rglob("*.xplane.pb"))  # the jax.profiler trace


def test_bench_kernels_plot(tmp_path):
    result = CliRunner().invoke(cli, ["bench", "kernels", "--small", "--plot",
                                      str(tmp_path / "roofline.png")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "roofline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_rejects_model_and_preset(tmp_path):
    result = CliRunner().invoke(cli, ["bench", "latency", "--preset", "tiny", "--model", "x"])
    assert result.exit_code == 1 and "not both" in result.output


def test_bench_serve_tiny(tmp_path):
    """The load generator against a real `jaxinfer serve` process on loopback."""
    data = _run(["serve", "--preset", "tiny", "--dtype", "float32", "--num-requests", "6",
                 "--concurrency", "3", "--input-len", "20", "--output-len", "8",
                 "--kv-cache-gb", "0.01", "--max-num-seqs", "4", "--max-num-batched-tokens",
                 "64", "--decode-steps", "4", "--page-size", "8", "--no-server-warmup",
                 "--warmup-passes", "0"],
                tmp_path)
    assert data["num_requests"] == 6 and data["output_tokens_per_s"] > 0
    for key in ("ttft_ms", "itl_ms", "latency_ms"):
        p = data[key]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"], (key, p)
    assert 0 < data["fraction_of_roofline"] and data["roofline_output_tokens_per_s"] > 0
