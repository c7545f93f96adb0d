#!/usr/bin/env bash
# A/B of batch-1 decode between two builds on the device: the wheel in .whl/ (B, this tree) and
# the one in .whl/base/ (A, e.g. the commit before a restructure: `git archive REV | tar -x -C D`,
# then `pip wheel --no-deps D -w .whl/base`), run in turn by bench/ab_bench.py; log under $OUT.
#   device run: [BENCH=throughput] bash bench/gpu_ab.sh [ROUNDS] [-- ARGS [--- ARGS ...]]
#   (carry: .whl). BENCH: the bench command compared (default latency). B_ENV=NAME=VALUE: set
#   for B's runs only (with the same wheel in both: A/B a compiler flag).
# Without ARGS, latency: Llama-3-8B and gpt-oss-20b bf16, and Qwen3-30B-A3B bf16 where it fits
# (an H200) or int8 (an H100 80GB: its bf16 weights do not fit beside the KV cache);
# throughput: Llama-3-8B, 512 requests of 128-256 in / 256 out, at the defaults.
source "$(dirname "$0")/device_env.sh"  # B's wheel -> /tmp/site, $OUT, $REPO, cd /tmp
rm -rf /tmp/site_a; python3 -m pip install -q --no-index --no-deps --no-compile \
  --target /tmp/site_a "$REPO"/.whl/base/jaxinfer-*.whl || exit 1
mkdir -p /tmp/ab; rounds=${1:-3}; shift || true
[ "${1:-}" = "--" ] && shift
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/ab.log"
bench=${BENCH:-latency}
if [ $# -eq 0 ] && [ "$bench" = throughput ]; then
  set -- --preset llama3-8b --num-requests 512 --input-len 256 --output-len 256
elif [ $# -eq 0 ]; then
  common="--batch 1 --input-len 512 --output-len 128 --kv-cache-gb 8 --decode-steps 32 --repeats 3"
  qwen3=""
  nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100 && qwen3="--quantize int8"
  set -- --preset llama3-8b $common --- --preset gpt-oss-20b $common \
    --- --preset qwen3-30b-a3b $qwen3 $common
fi
b_env=(); [ -n "${B_ENV:-}" ] && b_env=(--b-env "$B_ENV")
python3 "$REPO/bench/ab_bench.py" --a /tmp/site_a --b /tmp/site --bench "$bench" --rounds "$rounds" \
  --out /tmp/ab "${b_env[@]}" -- "$@" 2>&1 | tee -a "$OUT/ab.log"
