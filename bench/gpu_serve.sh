#!/usr/bin/env bash
# One device lease for the serving engine (issue 6): host overhead (CUPTI), batch-1 latency,
# 64-request throughput, then the HTTP load generator against `jaxinfer serve`.
#   device run: bash bench/gpu_serve.sh [part...]   (carry: .whl = the jaxinfer wheel plus the
#   fastapi / starlette / pydantic / uvicorn wheels, see bench/RESULTS.md)
source "$(dirname "$0")/device_env.sh"  # wheels -> /tmp/site, $OUT, $REPO, cd /tmp
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
  $(ls $REPO/.whl/*.whl | grep -v /jaxinfer-) 2>&1 | grep -v "^WARNING" | tail -2
J="python3 -m jaxinfer.cli.main"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
parts=${*:-"overhead latency throughput serve"}
for part in $parts; do
  case $part in
  overhead)
    for steps in 1 8; do
      python3 $REPO/bench/host_overhead.py --preset llama3-8b --batch 1 --decode-steps $steps \
        --json $OUT/overhead_b1_n$steps.json 2>&1 | grep -v "^WARNING" | tail -2
    done ;;
  overhead64)
    python3 $REPO/bench/host_overhead.py --preset llama3-8b --batch 64 --ctx 1152 \
      --decode-steps 8 --json $OUT/overhead_b64_n8.json 2>&1 | grep -v "^WARNING" | tail -2 ;;
  latency)
    $J bench latency --preset llama3-8b --batch 1 --input-len 512 --output-len 128 \
      --kv-cache-gb 8 --decode-steps 8 --record $OUT/RESULTS.md --json $OUT/latency_b1.json \
      2>&1 | grep -v "^WARNING" ;;
  throughput)
    $J bench throughput --preset llama3-8b --num-requests 64 --input-len 1024 --output-len 256 \
      --max-num-seqs 64 --max-num-batched-tokens 2048 --kv-cache-gb 24 --decode-steps 8 \
      --record $OUT/RESULTS.md --json $OUT/throughput.json 2>&1 | grep -v "^WARNING" ;;
  serve)
    # The server's own warm-up would compile ~50 Llama-8B step shapes; a warm-up pass of
    # the load (other prompts, same lengths) compiles the ones this load uses instead.
    $J bench serve --preset llama3-8b --num-requests 64 --concurrency 64 --input-len 1024 \
      --output-len 256 --max-num-seqs 64 --max-num-batched-tokens 2048 --kv-cache-gb 24 \
      --max-model-len 1536 --decode-steps 8 --no-server-warmup --record $OUT/RESULTS.md \
      --json $OUT/serve_c64.json 2>&1 | grep -v "^WARNING\|INFO:" ;;
  esac
done
