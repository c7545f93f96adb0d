#!/usr/bin/env bash
# MoE on the device: the grouped-matmul GPU tests, the kernel table
# (bench/grouped_matmul_kernels.py), and Qwen3-30B-A3B-shaped batch-1 decode end to end
# (bf16: needs an H200).
#   device run: bash bench/gpu_moe.sh [part...]   (parts: tests kernels e2e; carry: .whl)
source "$(dirname "$0")/device_env.sh"  # wheel -> /tmp/site, $OUT, $REPO, cd /tmp
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for part in ${*:-tests kernels e2e}; do
  case $part in
  tests)
    timeout -k 5 240 python3 -m pytest "$REPO/tests/test_grouped_matmul.py" \
      "$REPO/tests/test_grouped_matmul_mosaic.py" -c "$REPO/pyproject.toml" --rootdir "$REPO" \
      -m gpu --import-mode=importlib -q -rs -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
    tail -4 "$OUT/gpu_tests.log" ;;
  kernels)
    timeout -k 5 300 python3 "$REPO/bench/grouped_matmul_kernels.py" --out "$OUT/grouped.md" \
      > "$OUT/grouped.log" 2>&1; grep -v "^WARNING" "$OUT/grouped.md" 2>/dev/null \
      || tail -20 "$OUT/grouped.log" ;;
  e2e)
    timeout -k 5 300 python3 -m jaxinfer.cli.main bench latency --preset qwen3-30b-a3b \
      --batch 1 --input-len 512 --output-len 128 --kv-cache-gb 8 --decode-steps "${DECODE_STEPS:-8}" \
      --record "$OUT/RESULTS.md" --json "$OUT/moe_latency_b1.json" > "$OUT/e2e.log" 2>&1
    grep -v "^WARNING" "$OUT/e2e.log" | tail -8 ;;
  esac
done
