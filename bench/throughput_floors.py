"""The floors of a `jaxinfer bench throughput` run, without a GPU: replays the run's schedule
(the same prompt lengths and engine settings, hence the same steps) through
`jaxinfer.benchmarks.end_to_end.bench_throughput`'s accounting (the weights a step reads:
`jaxinfer.loading.weights`), with a runner that returns its tokens at once and the ceilings
the run measured. Checks or recomputes a recorded run's floor rows.

    python bench/throughput_floors.py --preset llama3-8b --num-requests 64 --input-len 1024 \\
        --output-len 256 --max-num-seqs 64 --max-num-batched-tokens 2048 --kv-cache-gb 24 \\
        --decode-steps 32 --copy-gbps 2945.9 --matmul-tflops 820.84 --seconds 4.2988
"""

from __future__ import annotations

import argparse
import types

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.benchmarks.end_to_end import bench_throughput
from jaxinfer.benchmarks.harness import Ceilings
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.runner import StepOutput
from jaxinfer.loading.presets import preset_config
from jaxinfer.models import Decoder


class InstantRunner:
    """The engine's runner interface; each sequence gets min(num_steps, remaining) tokens."""

    def __init__(self, config, num_pages: int, page_size: int):
        self.config, self.num_pages, self.page_size = config, num_pages, page_size

    def launch(self, chunks, num_steps, with_logprobs):
        return [min(num_steps, c.remaining) for c in chunks]

    def collect(self, counts):
        tokens = np.full((len(counts), max(counts)), -1, np.int32)
        for s, n in enumerate(counts):
            tokens[s, :n] = 2
        return StepOutput(tokens)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama3-8b")
    for name, default in (("num-requests", 64), ("input-len", 1024), ("output-len", 256),
                          ("max-num-seqs", 64), ("max-num-batched-tokens", 2048),
                          ("decode-steps", 32), ("page-size", 16)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--kv-cache-gb", type=float, default=24)
    ap.add_argument("--copy-gbps", type=float, required=True, help="the run's copy ceiling")
    ap.add_argument("--matmul-tflops", type=float, required=True)
    ap.add_argument("--seconds", type=float, default=None, help="the run's measured time")
    args = ap.parse_args()
    c = preset_config(args.preset)
    # Shapes only: bench_throughput reads the parameters' sizes and dtypes, not their values.
    model = nnx.eval_shape(lambda: Decoder(c, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    page_bytes = args.page_size * c.kv_bytes_per_token(2)  # bf16
    num_pages = int(args.kv_cache_gb * 2**30) // page_bytes  # as LLM sizes its pool
    max_model_len = min(c.max_position_embeddings, num_pages * args.page_size)
    engine = Engine(InstantRunner(c, num_pages, args.page_size), c.eos_token_ids,
                    max_model_len, args.max_num_seqs, args.max_num_batched_tokens,
                    decode_steps=args.decode_steps)
    llm = types.SimpleNamespace(config=c, engine=engine, model=model,
                                runner=types.SimpleNamespace(
                                    mesh=types.SimpleNamespace(size=1), page_size=args.page_size,
                                    kv_avals=[(np.zeros(0, jnp.bfloat16),) * 2]))  # bf16 pages
    ceilings = Ceilings(args.copy_gbps * 1e9, args.matmul_tflops * 1e12)
    summary, rows = bench_throughput(llm, args.num_requests, args.input_len, args.output_len,
                                     ceilings)
    print("| what | MB moved | GFLOP | floor (us) |\n| --- | --- | --- | --- |")
    for r in rows:  # the replay's own times mean nothing: floors only
        print(f"| {r['name']} | {r['bytes'] / 1e6:.1f} | {r['flops'] / 1e9:.2f} | "
              f"{r['floor_us']:.1f} |")
    print(f"{summary['steps']} steps ({summary['decode_steps_run']} decode-only), "
          f"{summary['tokens_run']} tokens run, floor {summary['floor_seconds']:.4f} s, "
          f"decode-only roofline {summary['decode_roofline_tokens_per_s']:.1f} tokens/s")
    if args.seconds:
        share = summary["floor_seconds"] / args.seconds
        print(f"measured {args.seconds:.4f} s: the floor is {100 * share:.1f}% of it")


if __name__ == "__main__":
    main()
