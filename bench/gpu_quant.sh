#!/usr/bin/env bash
# The quantized matmuls on the device: their GPU tests, then bench/quantized_matmul_kernels.py;
# logs and tables under $OUT (quant_tests.log, quant_bench.log, quantized_matmul.md / .json).
#   device run: bash bench/gpu_quant.sh [bench args, e.g. --quick]
#   (carry: .whl, from `pip wheel --no-deps . -w .whl`; SKIP_TESTS=1 skips the tests)
source "$(dirname "$0")/device_env.sh"  # wheel -> /tmp/site, $OUT, $REPO, cd /tmp
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest "$REPO/tests/test_quantized_matmul.py" \
    -c "$REPO/pyproject.toml" --rootdir "$REPO" -m gpu --import-mode=importlib -q -rs \
    -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 \
    | grep -v "^WARNING" | tee "$OUT/quant_tests.log" | tail -40
fi
# --max-minutes stops starting new cells before the timeout kills the run (tables so far are
# in quantized_matmul.md, rewritten after every shape).
timeout ${BENCH_TIMEOUT:-480} python3 "$REPO/bench/quantized_matmul_kernels.py" \
  --out "$OUT/quantized_matmul.md" --json "$OUT/quantized_matmul.json" "$@" 2>&1 \
  | grep -v "^WARNING" | tee "$OUT/quant_bench.log"
