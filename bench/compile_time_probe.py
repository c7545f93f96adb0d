"""Probe: where a step program's compile time goes, for a few shapes of a preset, with no
cache: tracing and lowering (Python) against XLA's compile.
    python bench/compile_time_probe.py [PRESET]   (default llama3-8b)
"""

import os
import sys
import time

os.environ["JAXINFER_COMPILATION_CACHE"] = "0"  # before jaxinfer reads them
os.environ["JAXINFER_EXECUTABLE_CACHE"] = "0"

from jaxinfer.engine.compiled_steps import StepShape  # noqa: E402
from jaxinfer.llm import LLM  # noqa: E402
from jaxinfer.loading import presets  # noqa: E402


def main():
    preset = sys.argv[1] if len(sys.argv) > 1 else "llama3-8b"
    t = time.perf_counter()
    llm = LLM(presets.random_model(presets.preset_config(preset)), kv_cache_bytes=4 << 30,
              max_num_seqs=64, max_num_batched_tokens=2048)
    print(f"load {time.perf_counter() - t:.1f} s", flush=True)
    r = llm.runner
    for shape in [StepShape("sample", 1, 1, 4), StepShape("sample", 1, 1, 128),
                  StepShape("sample", 64, 64, 128), StepShape("sample", 2048, 1, 128)]:
        args = r.example_args(shape)
        t0 = time.perf_counter()
        lowered = r.lower(shape, *args)
        t1 = time.perf_counter()
        lowered.compile()
        t2 = time.perf_counter()
        print(f"{shape}: trace + lower {t1 - t0:.2f} s, compile {t2 - t1:.2f} s", flush=True)


if __name__ == "__main__":
    main()
