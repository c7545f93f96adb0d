"""Bad input: a one-line error naming the file or field, a non-zero exit, no output left."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from jaxinfer import LLM, JaxinferError, SamplingParams
from jaxinfer.cli.main import cli


def _fails_cleanly(args, must_name, out=None):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code != 0
    assert not isinstance(result.exception, Exception) or isinstance(
        result.exception, SystemExit), result.exception
    # Everything printed but tqdm's progress-bar redraws ("... | 3/21 [00:00<...").
    lines = [seg for seg in re.split(r"[\r\n]", result.output)
             if seg.strip() and not re.search(r"\| *\d+/\d+ \[", seg)]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    assert must_name in lines[0], lines[0]
    if out is not None:
        assert not out.exists()
        assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp")]
    return lines[0]


@pytest.fixture
def hf_copy(hf_models, tmp_path):
    dst = tmp_path / "src"
    shutil.copytree(hf_models["llama"], dst)
    return dst


def test_missing_dir(tmp_path):
    _fails_cleanly(["convert", tmp_path / "nope", tmp_path / "out"], "nope", tmp_path / "out")


def test_dir_without_config(hf_copy, tmp_path):
    (hf_copy / "config.json").unlink()
    _fails_cleanly(["convert", hf_copy, tmp_path / "out"], "config.json", tmp_path / "out")


def test_dir_without_weights(hf_copy, tmp_path):
    (hf_copy / "model.safetensors").unlink()
    _fails_cleanly(["convert", hf_copy, tmp_path / "out"], "safetensors", tmp_path / "out")


def test_index_names_missing_shard(hf_copy, tmp_path):
    (hf_copy / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    _fails_cleanly(["convert", hf_copy, tmp_path / "out"], "model-00002-of-00002.safetensors",
                   tmp_path / "out")


def test_checkpoint_missing_a_tensor(hf_copy, tmp_path):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(hf_copy / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, hf_copy / "model.safetensors", metadata={"format": "pt"})
    _fails_cleanly(["convert", hf_copy, tmp_path / "out"], "layers.1.mlp.up_proj.weight",
                   tmp_path / "out")


def test_unsupported_architecture(hf_copy, tmp_path):
    cfg = json.loads((hf_copy / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (hf_copy / "config.json").write_text(json.dumps(cfg))
    line = _fails_cleanly(["convert", hf_copy, tmp_path / "out"], "config.json", tmp_path / "out")
    assert "GPT2LMHeadModel" in line


def test_truncated_safetensors(hf_copy, tmp_path):
    f = hf_copy / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    _fails_cleanly(["convert", hf_copy, tmp_path / "out"], "model.safetensors", tmp_path / "out")


@pytest.mark.parametrize("where", ["header", "metadata", "tensor list", "tensor data"])
def test_truncated_gguf(smollm2_gguf, tmp_path, where):
    """A cut in each part of the file is named, with the bytes the reader needed."""
    import gguf

    reader = gguf.GGUFReader(smollm2_gguf)
    tensor_list = reader.tensors[0].field.offset  # where the tensors' info records start
    t = reader.tensors[1]
    assert 4096 < tensor_list
    keep, says = {
        "header": (10, "the header needs"),  # the fixed header is 24 bytes
        "metadata": (4096, "the metadata needs"),
        "tensor list": (tensor_list + 5, "the tensor list needs"),
        "tensor data": (t.data_offset + t.n_bytes - 1,
                        f"tensor {t.name} needs {t.n_bytes} bytes at offset {t.data_offset}"),
    }[where]
    src = tmp_path / "model.gguf"
    with open(smollm2_gguf, "rb") as f:
        src.write_bytes(f.read(keep))
    line = _fails_cleanly(["convert", src, tmp_path / "out"], "model.gguf", tmp_path / "out")
    assert says in line and line.endswith(f"the file has {keep}"), line


def test_shape_disagrees_with_config(hf_copy, tmp_path):
    cfg = json.loads((hf_copy / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (hf_copy / "config.json").write_text(json.dumps(cfg))
    line = _fails_cleanly(["convert", hf_copy, tmp_path / "out"], "model.safetensors",
                          tmp_path / "out")
    assert "mlp" in line and "96" in line


def test_output_exists(hf_copy, tmp_path):
    (tmp_path / "out").mkdir()
    _fails_cleanly(["convert", hf_copy, tmp_path / "out"], "already exists")


def test_prompt_longer_than_context(hf_models):
    line = _fails_cleanly(["generate", "--model", hf_models["llama"],
                           "--prompt", "printing press " * 400], "max_model_len")
    assert "256" in line  # the tiny model's max_position_embeddings


def test_corrupt_converted_checkpoint(hf_models, tmp_path):
    out = tmp_path / "ckpt"
    assert CliRunner().invoke(cli, ["convert", str(hf_models["qwen3"]), str(out)]).exit_code == 0
    cfg = json.loads((out / "model_config.json").read_text())
    cfg["num_layers"] = 3  # the weights hold 2 layers
    (out / "model_config.json").write_text(json.dumps(cfg))
    _fails_cleanly(["generate", "--model", out, "--prompt", "hi"], "layers.2")


def test_rope_scaling_missing_keys(hf_copy, tmp_path):
    cfg = json.loads((hf_copy / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0}
    (hf_copy / "config.json").write_text(json.dumps(cfg))
    line = _fails_cleanly(["convert", hf_copy, tmp_path / "out"], "rope_scaling",
                          tmp_path / "out")
    assert "low_freq_factor" in line


def test_qwen_per_layer_sliding_window_is_refused(hf_models, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(hf_models["qwen2"], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(use_sliding_window=True, sliding_window=16)
    (src / "config.json").write_text(json.dumps(cfg))
    _fails_cleanly(["convert", src, tmp_path / "out"], "use_sliding_window", tmp_path / "out")


def test_output_under_a_file(hf_copy, tmp_path):
    (tmp_path / "afile").write_text("x")
    _fails_cleanly(["convert", hf_copy, tmp_path / "afile" / "out"], "afile")


def test_failed_convert_removes_the_parents_it_made(hf_copy, tmp_path):
    (hf_copy / "model.safetensors").write_bytes(b"\0" * 100)
    _fails_cleanly(["convert", hf_copy, tmp_path / "new" / "deeper" / "out"], "model.safetensors")
    assert not (tmp_path / "new").exists()


def test_convert_removes_what_killed_converts_left(hf_models, tmp_path):
    """A dead process's temporary directory for the same target goes; a live process's (this
    one's: a convert running beside), and one for another target, stay."""
    from jaxinfer.loading.checkpoint import _tmp_prefix

    dead_pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                                  capture_output=True, text=True, check=True).stdout)
    out = tmp_path / "out"
    stale = tmp_path / (_tmp_prefix(out, dead_pid) + "abc123")
    live = tmp_path / (_tmp_prefix(out, os.getpid()) + "def456")
    other = tmp_path / (_tmp_prefix(tmp_path / "other", dead_pid) + "ghi789")
    assert stale.name.startswith(".out.tmp-")
    for d in (stale, live, other):
        (d / "weights").mkdir(parents=True)
    result = CliRunner().invoke(cli, ["convert", str(hf_models["llama"]), str(out)])
    assert result.exit_code == 0, result.output
    assert not stale.exists() and live.exists() and other.exists()
    assert (out / "model_config.json").exists()


def test_model_config_with_unknown_field(hf_models, tmp_path):
    out = tmp_path / "ckpt"
    assert CliRunner().invoke(cli, ["convert", str(hf_models["llama"]), str(out)]).exit_code == 0
    cfg = json.loads((out / "model_config.json").read_text())
    cfg["num_wings"] = 8
    (out / "model_config.json").write_text(json.dumps(cfg))
    _fails_cleanly(["generate", "--model", out, "--prompt", "hi"], "num_wings")


def test_huge_seed_is_accepted(hf_models):
    result = CliRunner().invoke(cli, ["generate", "--model", str(hf_models["llama"]), "--prompt",
                                      "The", "--max-new-tokens", "2", "--temperature", "1",
                                      "--seed", str(2**33)])
    assert result.exit_code == 0, result.output


def test_bench_rejects_zero_sequences():
    result = CliRunner().invoke(cli, ["bench", "latency", "--preset", "tiny",
                                      "--max-num-seqs", "0"])
    assert result.exit_code == 2 and "max-num-seqs" in result.output


@pytest.mark.parametrize("page_size", ["24", "128"])
def test_bench_rejects_a_page_size_the_kernels_cannot_take(page_size):
    result = CliRunner().invoke(cli, ["bench", "latency", "--preset", "tiny", "--page-size",
                                      page_size])
    assert result.exit_code == 1, result.output
    assert f"page_size {page_size}: a power of two up to 64" in result.output
    assert "Traceback" not in result.output


def test_library_rejects_bad_prompts_and_leaves_nothing_queued(hf_models):

    llm = LLM(hf_models["llama"], dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=2)
    with pytest.raises(JaxinferError, match="outside the vocabulary"):
        llm.generate([[5, 6, 7], [5, 10**6]], params)
    with pytest.raises(JaxinferError, match="max_model_len"):
        llm.generate([[5, 6, 7], [5] * 300], params)
    assert not llm.engine.has_unfinished()
    assert llm.engine.stats().num_free_pages == llm.runner.num_pages
    assert len(llm.generate([[5, 6, 7]], params)) == 1


def test_moe_config_with_bad_top_k(hf_models, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(hf_models["qwen3_moe"], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_experts_per_tok"] = 99
    (src / "config.json").write_text(json.dumps(cfg))
    _fails_cleanly(["generate", "--model", src, "--prompt", "hi"], "num_experts_per_tok")
