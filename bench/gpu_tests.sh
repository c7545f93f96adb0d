#!/usr/bin/env bash
# The GPU test suite on the device machine: `pytest -m gpu` against the installed wheel.
#   device run: bash bench/gpu_tests.sh   (carry: .whl, built with `pip wheel --no-deps . -w .whl`)
source "$(dirname "$0")/device_env.sh"  # wheel -> /tmp/site, $OUT, $REPO, cd /tmp
# Only the files with GPU-marked tests: the others may import what the device lacks (openai).
python3 -m pytest $(grep -l "pytest.mark.gpu\|marks=gpu" "$REPO"/tests/test_*.py) -c "$REPO/pyproject.toml" --rootdir "$REPO" -m gpu \
  --import-mode=importlib -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
