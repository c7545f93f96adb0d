"""A/B of `jaxinfer bench latency` or `bench throughput` between two installed builds of
jaxinfer, run in turn.

  python bench/ab_bench.py --a DIR --b DIR [--bench throughput] [--rounds 3] [--out DIR]
      [--b-env NAME=VALUE] -- ARGS [--- ARGS ...]     (on the device: bash bench/gpu_ab.sh)

DIR is a site directory holding one build (e.g. `pip install --target DIR jaxinfer-*.whl`);
each ARGS is one argument list of the bench command (e.g. `--preset llama3-8b --batch 1
--decode-steps 32`). For each ARGS the two builds run in turn, A B A B ... for --rounds
rounds, each in a fresh process; the table gives each build's figures (latency: per-token
decode time and time to first token; throughput: output and decode-only tokens/s), the
median of its runs, the B / A ratios and every run's first figure, so that run-to-run spread
can be set against the difference. Use it to check that a change moves no figure, or by
how much it moves one.
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

# Per bench command: (label, key of its --json output) of the figures compared.
FIGURES = {
    "latency": [("itl ms", "itl_ms"), ("TTFT ms", "ttft_ms")],
    "throughput": [("output tokens/s", "output_tokens_per_s"),
                   ("decode-only tokens/s", "decode_tokens_per_s")],
}


def run_once(site: str, bench: str, args: list[str], out: Path,
             extra_env: dict[str, str] | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=site, PYTHONUNBUFFERED="1", **(extra_env or {}))
    cmd = [sys.executable, "-m", "jaxinfer.cli.main", "bench", bench, *args,
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
    p.add_argument("--bench", choices=sorted(FIGURES), default="latency")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=tempfile.gettempdir(), help="where each run's JSON goes")
    p.add_argument("--b-env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable set for B's runs only (e.g. XLA_FLAGS=...: "
                        "A/B a compiler option with one build as both)")
    opts = p.parse_args(argv[:split])
    b_env = dict(kv.split("=", 1) for kv in opts.b_env)
    groups, current = [], []
    for a in argv[split + 1:]:
        if a == "---":
            groups.append(current)
            current = []
        else:
            current.append(a)
    groups.append(current)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    figures = FIGURES[opts.bench]
    head = [f"bench {opts.bench} args"]
    for label, _ in figures:
        head += [f"A {label} (median)", f"B {label} (median)", "B / A"]
    head += [f"A runs ({figures[0][0]})", f"B runs ({figures[0][0]})"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for g, args in enumerate(groups):
        runs = {(name, key): [] for name in ("a", "b") for _, key in figures}
        for r in range(opts.rounds):
            for name in ("a", "b"):
                res = run_once(getattr(opts, name), opts.bench, args,
                               out / f"ab_{g}_{r}_{name}.json", b_env if name == "b" else None)
                for _, key in figures:
                    runs[name, key].append(res[key])
                print(f"{' '.join(args)} round {r} {name.upper()}: " + ", ".join(
                    f"{label} {res[key]:.3f}" for label, key in figures), flush=True)
        row = [f"`{' '.join(args)}`"]
        for _, key in figures:
            a, b = statistics.median(runs["a", key]), statistics.median(runs["b", key])
            row += [f"{a:.3f}", f"{b:.3f}", f"{b / a:.3f}"]
        first = figures[0][1]
        row += [", ".join(f"{x:.3f}" for x in runs[name, first]) for name in ("a", "b")]
        lines.append("| " + " | ".join(row) + " |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
