"""A/B of `jaxinfer bench latency` between two installed builds of jaxinfer, run in turn.

  python bench/ab_latency.py --a DIR --b DIR [--rounds 3] [--out DIR] -- ARGS [--- ARGS ...]
  (on the device: bash bench/gpu_ab.sh)

DIR is a site directory holding one build (e.g. `pip install --target DIR jaxinfer-*.whl`);
each ARGS is one `jaxinfer bench latency` argument list (e.g. `--preset llama3-8b --batch 1
--decode-steps 32`). For each ARGS the two builds run in turn, A B A B ... for --rounds
rounds, each in a fresh process; the table gives each build's per-token decode time and
time to first token (the median of its runs' medians), the B / A ratios and every run's
decode figure, so that run-to-run spread can be set against the difference. Use it to
check that a change moves no figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_once(site: str, args: list[str], out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=site, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "jaxinfer.cli.main", "bench", "latency", *args,
           "--json", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    if proc.returncode != 0:
        raise SystemExit(f"failed ({site}): {' '.join(args)}\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def main():
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", required=True, help="site dir of build A (the baseline)")
    p.add_argument("--b", required=True, help="site dir of build B")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=tempfile.gettempdir(), help="where each run's JSON goes")
    opts = p.parse_args(argv[:split])
    groups, current = [], []
    for a in argv[split + 1:]:
        if a == "---":
            groups.append(current)
            current = []
        else:
            current.append(a)
    groups.append(current)
    out = Path(opts.out)
    lines = ["| bench latency args | A itl ms (median) | B itl ms (median) | B / A | A runs | "
             "B runs | A TTFT ms | B TTFT ms | B / A |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for g, args in enumerate(groups):
        runs, ttft = {"a": [], "b": []}, {"a": [], "b": []}
        for r in range(opts.rounds):
            for name in ("a", "b"):
                res = run_once(getattr(opts, name), args, out / f"ab_{g}_{r}_{name}.json")
                runs[name].append(res["itl_ms"])
                ttft[name].append(res["ttft_ms"])
                print(f"{' '.join(args)} round {r} {name.upper()}: {res['itl_ms']:.3f} ms, "
                      f"TTFT {res['ttft_ms']:.1f} ms", flush=True)
        a, b = statistics.median(runs["a"]), statistics.median(runs["b"])
        ta, tb = statistics.median(ttft["a"]), statistics.median(ttft["b"])
        lines.append(f"| `{' '.join(args)}` | {a:.3f} | {b:.3f} | {b / a:.3f} | "
                     f"{', '.join(f'{x:.3f}' for x in runs['a'])} | "
                     f"{', '.join(f'{x:.3f}' for x in runs['b'])} | {ta:.1f} | {tb:.1f} | "
                     f"{tb / ta:.3f} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
