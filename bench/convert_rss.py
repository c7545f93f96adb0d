"""Peak RSS of `jaxinfer convert` against model size: a synthetic Llama-shaped HF checkpoint
(random safetensors, written one layer per file) converted in a child process.

    python bench/convert_rss.py --layers 2 24 --hidden 1024 --vocab 32000
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from jaxinfer.benchmarks.harness import convert_in_child_process


def write_checkpoint(path: Path, layers: int, hidden: int, vocab: int):
    from safetensors.numpy import save_file

    inter, rng = 4 * hidden, np.random.default_rng(0)
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": 16,
           "num_key_value_heads": 4, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
           "tie_word_embeddings": False}
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    kv = hidden // 4
    weight_map = {}

    def save(name, tensors):
        save_file({k: rng.standard_normal(s, dtype=np.float32) for k, s in tensors.items()},
                  path / name)
        weight_map.update(dict.fromkeys(tensors, name))

    save("embed.safetensors", {"model.embed_tokens.weight": (vocab, hidden),
                               "lm_head.weight": (vocab, hidden), "model.norm.weight": (hidden,)})
    for i in range(layers):
        p = f"model.layers.{i}."
        save(f"layer{i}.safetensors", {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter)})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 24])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    args = ap.parse_args()
    print("| layers | source f32 size (MB) | largest tensor f32 (MB) | convert wall (s) "
          "| peak RSS (MB) |\n| --- | --- | --- | --- | --- |")
    for layers in args.layers:
        with tempfile.TemporaryDirectory() as tmp:
            size = write_checkpoint(Path(tmp) / "src", layers, args.hidden, args.vocab)
            wall, rss = convert_in_child_process(f"{tmp}/src", f"{tmp}/out", "bfloat16")
            largest = args.vocab * args.hidden * 4 / 2**20
            print(f"| {layers} | {size / 2**20:.0f} | {largest:.0f} | {wall:.1f} "
                  f"| {rss / 2**20:.0f} |")


if __name__ == "__main__":
    main()
