#!/usr/bin/env bash
# The GPU test suite on the device machine: `pytest -m gpu` against the installed wheel.
#   device run: bash bench/gpu_tests.sh   (carry: .whl, built with `pip wheel --no-deps . -w .whl`)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
rm -rf /tmp/site; python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
  .whl/jaxinfer-*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
# Run from outside the checkout, in importlib mode, so that the checkout's jaxinfer/ folder
# stays off sys.path (it would shadow the installed wheel).
REPO=$(pwd); cd /tmp
python3 -m pytest "$REPO/tests" -c "$REPO/pyproject.toml" --rootdir "$REPO" -m gpu \
  --import-mode=importlib -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
