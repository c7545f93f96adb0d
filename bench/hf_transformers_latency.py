"""HF transformers + torch on the same GPU, the same random-weight shape: time to first
token and per-token decode time, for side-by-side figures with `jaxinfer bench latency`.
Timed with torch's own clock and synchronisation (the jaxinfer harness times JAX work).

    python bench/hf_transformers_latency.py --preset llama3-8b --input-len 512 \\
        --output-len 128 --batch 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SHAPES = {  # the same shapes as jaxinfer.loading.presets
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**SHAPES[args.preset])).eval()
    ids = torch.randint(2, 128000, (args.batch, args.input_len), device="cuda")

    def torch_timed(fn):
        """(fn(), its seconds), torch's queued GPU work waited for before and after."""
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return out, time.perf_counter() - t

    with torch.no_grad():
        for _ in range(2):  # warm up
            model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        ttfts = [torch_timed(lambda: model(ids))[1] for _ in range(5)]
        _, total = torch_timed(lambda: model.generate(
            ids, max_new_tokens=args.output_len, min_new_tokens=args.output_len,
            do_sample=False))
    ttft = statistics.median(ttfts)
    itl = (total - ttft) / (args.output_len - 1)
    print(json.dumps({"impl": f"transformers {__import__('transformers').__version__} "
                              f"torch {torch.__version__}", "batch": args.batch,
                      "input_len": args.input_len, "output_len": args.output_len,
                      "ttft_ms": ttft * 1e3, "itl_ms": itl * 1e3,
                      "tokens_per_s": args.batch / itl}))


if __name__ == "__main__":
    main()
