# Sourced by the bench/gpu_*.sh scripts on the device machine: installs the jaxinfer wheel
# carried in .whl/ (built with `pip wheel --no-deps . -w .whl`) into /tmp/site, puts it on
# PYTHONPATH, sets OUT (logs) and REPO (the checkout), and moves to /tmp so that the
# checkout's jaxinfer/ folder does not shadow the installed package.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
rm -rf /tmp/site; python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
  .whl/jaxinfer-*.whl || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
REPO=$(pwd); cd /tmp
