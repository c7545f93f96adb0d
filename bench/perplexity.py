"""Perplexity of the default model (SmolLM2-135M, the Q4_1 GGUF it ships as) on a fixed text,
per weight format: each converted with `convert --quantize FORMAT` from the GGUF, run on the
CPU in bf16 (float32 for the float32 row), set against the float32 and bf16 runs. Prints a
markdown table.

    python bench/perplexity.py [--formats int8,nvfp4,...] [--text FILE] [--json FILE]

Rows: float32 and bf16 (the GGUF dequantized), gguf (its own Q4_1 blocks kept), and each
`--quantize` format; int4 / int8 group sizes must divide SmolLM2's 576 and 1536 (32 or 64).
The GGUF's weights are 4-bit already, so a 4-bit format rounds them a second time.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from jaxinfer import LLM
from jaxinfer.benchmarks.accuracy import agreement, perplexity
from jaxinfer.loading.checkpoint import convert
from jaxinfer.loading.default_model import default_gguf

TEXT = Path(__file__).parents[1] / "tests" / "data" / "perplexity_text.txt"
FORMATS = ("int8", "int8:g32", "int4:g32", "int4:g64", "int4:g32:asym", "fp8",
           "fp8:weight-only", "mxfp4", "nvfp4")
KV_BYTES = 64 << 20  # one prompt at a time


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--text", default=str(TEXT))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    src = default_gguf()
    text = Path(args.text).read_text()
    runs = {"float32": ("float32", "none"), "bf16": ("bfloat16", "none"),
            "gguf": ("bfloat16", None)}
    runs |= {f: ("bfloat16", f) for f in args.formats.split(",") if f}
    results, ids = {}, None
    with tempfile.TemporaryDirectory() as tmp:
        for name, (dtype, quantize) in runs.items():
            out = convert(src, Path(tmp) / name.replace(":", "_"), dtype, quantize=quantize,
                          progress=False)
            llm = LLM(out, kv_cache_bytes=KV_BYTES)
            ids = ids or llm.tokenizer.encode(text)
            logits = llm.logits([ids])[0]
            results[name] = {"logits": logits, "perplexity": perplexity(logits, ids),
                             "disk_bytes": disk_bytes(out)}
            print(f"{name}: {results[name]['perplexity']:.3f}", flush=True)
            del llm
    f32, bf16 = results["float32"], results["bf16"]
    print(f"\nSmolLM2-135M, {len(ids)} tokens of {Path(args.text).name}, CPU\n")
    print("| weights | perplexity | / float32 | / bf16 | top-1 = bf16's | max / mean "
          "abs logit diff vs bf16 | checkpoint MB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for name, r in results.items():
        near = agreement(r["logits"], bf16["logits"])
        row = {"weights": name, "perplexity": r["perplexity"],
               "vs_float32": r["perplexity"] / f32["perplexity"],
               "vs_bf16": r["perplexity"] / bf16["perplexity"], **near,
               "disk_mb": r["disk_bytes"] / 1e6}
        rows.append(row)
        print(f"| {name} | {row['perplexity']:.2f} | {row['vs_float32']:.3f} | "
              f"{row['vs_bf16']:.3f} | {row['top1']:.3f} | {row['max_abs_diff']:.2f} / "
              f"{row['mean_abs_diff']:.3f} | {row['disk_mb']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"tokens": len(ids), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
