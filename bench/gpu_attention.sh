#!/usr/bin/env bash
# The attention kernels on the device: their GPU tests, then bench/attention_kernels.py; logs
# under $OUT.
#   device run: bash bench/gpu_attention.sh [bench args]   (carry: .whl, from `pip wheel --no-deps . -w .whl`)
source "$(dirname "$0")/device_env.sh"  # wheel -> /tmp/site, $OUT, $REPO, cd /tmp
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest "$REPO/tests/test_attention.py" -c "$REPO/pyproject.toml" \
    --rootdir "$REPO" -m gpu --import-mode=importlib -q -rs -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 \
    | grep -v "^WARNING" | tee "$OUT/gpu_attention_tests.log" | tail -40
fi
timeout ${BENCH_TIMEOUT:-400} python3 "$REPO/bench/attention_kernels.py" --json "$OUT/attention.json" "$@" 2>&1 \
  | grep -v "^WARNING" | tee "$OUT/attention_bench.log"
