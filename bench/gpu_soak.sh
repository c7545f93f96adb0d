#!/usr/bin/env bash
# The serving soak and the concurrency-256 load test on the device, against one
# `jaxinfer serve --preset llama3-8b` (serve defaults, warm-up on): 1,000 requests at
# concurrency 128 with 10% of clients leaving mid-stream and 5% malformed, 50 completed
# requests compared with their solo runs; then 512 requests at concurrency 256. Logs under $OUT.
#   device run: bash bench/gpu_soak.sh [serve args...]   (carry: .whl, as bench/gpu_startup.sh)
source "$(dirname "$0")/device_env.sh"  # wheels -> /tmp/site, $OUT, $REPO, cd /tmp
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
  $(ls $REPO/.whl/*.whl | grep -v /jaxinfer-) 2>&1 | grep -v "^WARNING" | tail -2
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
PORT=8124; URL=http://127.0.0.1:$PORT
args=${*:-"--preset llama3-8b"}
python3 -m jaxinfer.cli.main serve $args --port $PORT > $OUT/soak_server.log 2>&1 &
pid=$!
until grep -q "ready in" $OUT/soak_server.log; do
  sleep 1; kill -0 $pid 2>/dev/null || { tail -5 $OUT/soak_server.log; exit 1; }
done
grep "ready in" $OUT/soak_server.log
J="python3 -m jaxinfer.cli.main bench serve --url $URL --warmup-passes 0"
$J --num-requests 1000 --concurrency 128 --input-len 512 --range-ratio 0.75 --output-len 128 \
  --disconnect-fraction 0.1 --malformed-fraction 0.05 --check-solo 50 \
  --json $OUT/soak.json 2>&1 | grep -v "^WARNING" | tail -12
$J --num-requests 512 --concurrency 256 --input-len 512 --range-ratio 0.75 --output-len 256 \
  --json $OUT/c256.json 2>&1 | grep -v "^WARNING" | tail -10
kill $pid; wait $pid 2>/dev/null
echo "server errors: $(grep -c 'Traceback' $OUT/soak_server.log)"
