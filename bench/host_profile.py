"""Where the host's time goes between device steps: cProfile around engine steps.

A decode workload (as `host_overhead.py`: B requests at --ctx tokens, the decode shapes
compiled first), then --steps engine steps under cProfile; prints the wall time per engine
step and the costliest functions. The jitted call blocks while XLA drives the decode loop,
so `_run_sample` holds the device time; the rest is host work the GPU waits for.

    cd bench; python host_profile.py --preset llama3-8b --batch 64 --ctx 1152 --decode-steps 32
    python bench/host_profile.py --preset tiny --batch 64 --ctx 64 --kv-cache-gb 0.1 \
        --time-finish 20   # CPU: Engine.finish alone
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=1152)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--steps", type=int, default=4, help="engine steps profiled")
    ap.add_argument("--kv-cache-gb", type=float, default=None,
                    help="KV pool (default: every sequence's whole length)")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--time-finish", type=int, default=0, metavar="N",
                    help="instead: time N calls of Engine.finish once their outputs are "
                    "ready (the per-token host work alone, no profiler)")
    a = ap.parse_args()
    import jax.numpy as jnp

    from jaxinfer import LLM, SamplingParams
    from jaxinfer.presets import preset_config, random_model

    config = preset_config(a.preset)
    max_len = a.ctx + (a.steps + 3) * a.decode_steps + 64
    kv_bytes = (int(a.kv_cache_gb * 2**30) if a.kv_cache_gb
                else int(1.1 * a.batch * max_len * config.kv_bytes_per_token(2)))
    llm = LLM(random_model(config, jnp.bfloat16), kv_cache_bytes=kv_bytes,
              max_model_len=max_len, max_num_seqs=a.batch, decode_steps=a.decode_steps)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_len - a.ctx - 1, ignore_eos=True)
    for i in range(a.batch):
        engine.add_request([2 + (i + j) % 500 for j in range(a.ctx)], params)
    while any(r.num_output == 0 for r in engine.running + list(engine.waiting)):
        engine.step()  # prefill
    for _ in range(2):
        engine.step()  # compile the decode shapes
    if a.time_finish:
        finish, spent = engine.finish, []

        def timed(launched):
            launched[1].out[0].block_until_ready()
            t = time.perf_counter()
            deltas = finish(launched)
            spent.append(time.perf_counter() - t)
            return deltas

        engine.finish = timed
        for _ in range(a.time_finish):
            engine.step()
        print(f"Engine.finish: {sum(spent) / len(spent) * 1e3:.2f} ms per call "
              f"({a.batch} x {a.decode_steps} tokens)")
        return
    profile = cProfile.Profile()
    t = time.perf_counter()
    profile.enable()
    for _ in range(a.steps):
        engine.step()
    profile.disable()
    print(f"{(time.perf_counter() - t) / a.steps * 1e3:.1f} ms per engine step "
          f"(B={a.batch}, {a.decode_steps} decode steps per call, under cProfile)")
    pstats.Stats(profile).sort_stats("tottime").print_stats(a.top)


if __name__ == "__main__":
    main()
