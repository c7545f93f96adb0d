"""Host wall time of each engine step of `jaxinfer bench latency`'s workload (one prompt of
--input-len random ids, --output-len greedy tokens, the CLI's engine settings), printed step
by step for the second, compiled run: where a decode's per-token time goes between steps.
`--ceilings-first` measures the device ceilings in this process first, as `jaxinfer bench`
would if it did not measure them in a child process: CUPTI slows every later launch.

    python bench/step_times.py --preset llama3-8b --mesh tp=1 --decode-steps 8
"""

from __future__ import annotations

import argparse
import time

import jax.numpy as jnp
import numpy as np

from jaxinfer import LLM, SamplingParams
from jaxinfer.benchmarks.harness import measure_ceilings
from jaxinfer.loading.presets import preset_config, random_model
from jaxinfer.sharding import MeshSpec


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--mesh", default=None)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--kv-cache-gb", type=float, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--ceilings-first", action="store_true",
                    help="measure the device ceilings in this process first (CUPTI-timed)")
    args = ap.parse_args()
    if args.ceilings_first:
        measure_ceilings()
    config = preset_config(args.preset)
    mesh = MeshSpec.parse(args.mesh).meshes()[0]
    llm = LLM(random_model(config, jnp.bfloat16, mesh=mesh),
              kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)), max_num_seqs=args.max_num_seqs,
              decode_steps=args.decode_steps, mesh=args.mesh)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for _ in range(2):  # the first run compiles
        llm.engine.add_request(rng.integers(2, config.vocab_size, args.input_len).tolist(),
                               params)
        times, tokens = [], []
        start = time.perf_counter()
        while llm.engine.has_unfinished():
            t = time.perf_counter()
            deltas = llm.engine.step()
            times.append(time.perf_counter() - t)
            tokens.append(sum(len(d.token_ids) for d in deltas))
        total = time.perf_counter() - start
    decode = sum(times[1:])
    print("step ms:", " ".join(f"{1e3 * t:.2f}({n})" for t, n in zip(times, tokens, strict=True)))
    print(f"total {1e3 * total:.1f} ms, prefill step {1e3 * times[0]:.2f} ms, decode steps "
          f"{1e3 * decode:.1f} ms for {sum(tokens[1:])} tokens = "
          f"{1e3 * decode / sum(tokens[1:]):.3f} ms/token; outside steps "
          f"{1e3 * (total - sum(times)):.2f} ms")


if __name__ == "__main__":
    main()
