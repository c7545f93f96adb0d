#!/usr/bin/env bash
# Start-up of `jaxinfer serve` on the device: time to ready from an empty cache (no
# compilation cache, no executable cache), one long request after ready (its context grows
# past several page buckets: nothing may compile), then time to ready again from the cache
# the first run filled.
#   device run: bash bench/gpu_startup.sh [serve args...]   (default: --preset llama3-8b)
#   (carry: .whl = the jaxinfer wheel plus the fastapi / starlette / pydantic / uvicorn wheels)
source "$(dirname "$0")/device_env.sh"  # wheels -> /tmp/site, $OUT, $REPO, cd /tmp
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
  $(ls $REPO/.whl/*.whl | grep -v /jaxinfer-) 2>&1 | grep -v "^WARNING" | tail -2
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
args=${*:-"--preset llama3-8b"}
export JAXINFER_CACHE=/tmp/startup_cache PORT=8123 READY_LIMIT=${READY_LIMIT:-420}
rm -rf "$JAXINFER_CACHE"
metrics() { curl -s localhost:$PORT/metrics | grep -E "^jaxinfer_step_programs" | tr '\n' ' '; echo; }
for run in cold warm; do
  log=$OUT/serve_$run.log
  python3 -m jaxinfer.cli.main serve $args --port $PORT > "$log" 2>&1 &
  pid=$!
  t0=$(date +%s); h=""
  until grep -q "ready in" "$log"; do
    sleep 1
    if [ -z "$h" ] && grep -q "model loaded" "$log"; then
      sleep 2; h=$(curl -s -m 10 localhost:$PORT/health); echo "   /health while warming up: $h"
    fi
    if ! kill -0 $pid 2>/dev/null || [ $(( $(date +%s) - t0 )) -gt $READY_LIMIT ]; then
      echo "== $run: not ready after $(( $(date +%s) - t0 )) s; /health: $(curl -s localhost:$PORT/health)"
      break
    fi
  done
  echo "== $run: $(grep -E 'model loaded|ready in' "$log" | tr '\n' ' ')"
  if grep -q "ready in" "$log"; then
    echo "   metrics at ready: $(metrics)"
    prompt=$(python3 -c "import random; print([random.randrange(2, 30000) for _ in range(100)])")
    start=$(date +%s.%N)
    curl -s localhost:$PORT/v1/completions -H 'Content-Type: application/json' \
      -d "{\"prompt\": $prompt, \"max_tokens\": 900, \"temperature\": 0, \"ignore_eos\": true}" \
      | python3 -c "import json,sys; print('   request:', json.load(sys.stdin)['usage'])"
    echo "   request took $(python3 -c "print(round($(date +%s.%N) - $start, 2))") s (context 100 -> 1000)"
    echo "   metrics after: $(metrics)"
  fi
  kill $pid; wait $pid 2>/dev/null
  tail -3 "$log"
done
