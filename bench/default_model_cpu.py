"""The default model (SmolLM2-135M, `jaxinfer.loading.default_model`) on the CPU: its
conversion (wall time, peak RSS against the largest tensor and against the imports alone,
each in a child process) and batch-1 greedy decode tokens/s. Prints a markdown table.

    python bench/default_model_cpu.py [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jaxinfer import LLM, SamplingParams
from jaxinfer.benchmarks.harness import convert_in_child_process
from jaxinfer.config import ModelConfig
from jaxinfer.loading.checkpoint import expected_shapes
from jaxinfer.loading.default_model import default_gguf

CHILD_IMPORT = """
import resource, jaxinfer.loading.checkpoint, gguf.quants, orbax.checkpoint.experimental.v1
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    gguf_path = default_gguf()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ckpt"
        wall, rss = convert_in_child_process(str(gguf_path), str(out), args.dtype)
        base_kb = subprocess.run([sys.executable, "-c", CHILD_IMPORT], capture_output=True,
                                 text=True, check=True).stdout.split()[0]
        config = ModelConfig.from_json_file(out / "model_config.json")
        itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[args.dtype]
        largest = max(math.prod(s) for s in expected_shapes(config).values())
        largest_mb = largest * itemsize / 2**20

        llm = LLM(out)
        prompt = llm.tokenizer.encode("The capital of France is")
        params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
        llm.generate([prompt], params)  # compile every bucket this run touches
        t = time.perf_counter()
        n = len(llm.generate([prompt], params)[0].token_ids)
        decode_s = time.perf_counter() - t
    rows = {
        "convert wall time (s)": f"{wall:.1f}",
        "convert peak RSS (MB)": f"{rss / 2**20:.0f}",
        "RSS of the imports alone (MB)": f"{int(base_kb) / 1024:.0f}",
        f"largest tensor, {args.dtype} (MB)": f"{largest_mb:.0f}",
        f"batch-1 greedy tokens/s (prompt 5, {args.new_tokens} new, warm)": f"{n / decode_s:.1f}",
    }
    print(json.dumps(rows))
    print("| what | figure |\n| --- | --- |")
    for k, v in rows.items():
        print(f"| {k} | {v} |")


if __name__ == "__main__":
    main()
