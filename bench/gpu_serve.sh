#!/usr/bin/env bash
# The serving engine on the device: host overhead (CUPTI), batch-1 latency, the batch-64
# decode phase, 64-request throughput, then the HTTP load generator against `jaxinfer
# serve` (the default parts). Other parts: overhead64, timeline (where the GPU idles), nocb
# and graphs (XLA command buffers / CUDA graphs off and on). Two builds in turn:
# bench/gpu_ab.sh.
#   device run: bash bench/gpu_serve.sh [part...]   (carry: .whl = the jaxinfer wheel plus the
#   fastapi / starlette / pydantic / uvicorn wheels, see bench/RESULTS.md)
source "$(dirname "$0")/device_env.sh"  # wheels -> /tmp/site, $OUT, $REPO, cd /tmp
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
  $(ls $REPO/.whl/*.whl | grep -v /jaxinfer-) 2>&1 | grep -v "^WARNING" | tail -2
J="python3 -m jaxinfer.cli.main"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
parts=${*:-"overhead latency latency64 throughput serve"}
N=${DECODE_STEPS:-32}  # decode steps per host round trip (the experiment parts name their own)
for part in $parts; do
  case $part in
  overhead)
    for steps in 1 8 $N; do
      python3 $REPO/bench/host_overhead.py --preset llama3-8b --batch 1 --decode-steps $steps \
        --json $OUT/overhead_b1_n$steps.json 2>&1 | grep -v "^WARNING" | tail -2
    done ;;
  overhead64)
    python3 $REPO/bench/host_overhead.py --preset llama3-8b --batch 64 --ctx 1152 \
      --decode-steps $N --steps 4 --top 15 --json $OUT/overhead_b64.json 2>&1 | grep -v "^WARNING" | tail -20 ;;
  timeline)  # where the GPU idles during decode (jax.profiler trace): batch 1 and 64, then
    # batch 1 with the decode loop in CUDA graphs
    graphs="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
    for run in "b1 --batch 1" "b64 --batch 64 --ctx 1152 --steps 3" "b1graphs --batch 1"; do
      set -- $run
      tag=$1; shift
      flags=""; [ "$tag" = b1graphs ] && flags="$graphs --xla_gpu_graph_min_graph_size=1"
      echo "== timeline $tag"
      XLA_FLAGS=$flags timeout -k 5 200 python3 "$REPO/bench/gpu_idle_gaps.py" \
        --preset llama3-8b --decode-steps 8 "$@" --json "$OUT/timeline_$tag.json" 2>&1 \
        | grep -v "^WARNING\|^W0000\|^I0000" | tail -18
    done ;;
  nocb)  # XLA's command buffers (CUDA graphs, on by default) off vs on, in turn
    nocb="--xla_gpu_enable_command_buffer="
    for round in 1 2; do
      for flags in "" "$nocb"; do
        echo "XLA_FLAGS=${flags:-(none)}: $(XLA_FLAGS=$flags $J bench latency --preset llama3-8b --batch 1 \
          --input-len 512 --output-len 128 --kv-cache-gb 8 --decode-steps 8 2>&1 | grep per-token)"
      done
    done
    for flags in "" "$nocb"; do
      echo "XLA_FLAGS=${flags:-(none)}: $(XLA_FLAGS=$flags python3 $REPO/bench/host_overhead.py \
        --preset llama3-8b --batch 64 --ctx 1152 --decode-steps 8 2>&1 | grep ms/token)"
    done
    XLA_FLAGS=$nocb timeout -k 5 200 python3 "$REPO/bench/gpu_idle_gaps.py" \
      --preset llama3-8b --decode-steps 8 --batch 1 --json "$OUT/timeline_nocb.json" 2>&1 \
      | grep -v "^WARNING\|^W0000\|^I0000" | tail -18 ;;
  latency)
    $J bench latency --preset llama3-8b --batch 1 --input-len 512 --output-len 128 \
      --kv-cache-gb 8 --decode-steps $N --record $OUT/RESULTS.md --json $OUT/latency_b1.json \
      2>&1 | grep -v "^WARNING" ;;
  latency64)  # the decode phase of 64 sequences of 1024 prompt tokens (the throughput batch)
    $J bench latency --preset llama3-8b --batch 64 --input-len 1024 --output-len 256 \
      --kv-cache-gb 24 --max-num-seqs 64 --max-num-batched-tokens 2048 --decode-steps $N \
      --json $OUT/latency_b64.json 2>&1 | grep -v "^WARNING" | tail -4 ;;
  graphs)  # batch-1 latency with and without the decode loop in CUDA graphs, in turn
    graphs="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
    for round in 1 2; do
      for flags in "" "$graphs --xla_gpu_graph_min_graph_size=1"; do
        echo "XLA_FLAGS=${flags:-(none)}"
        XLA_FLAGS=$flags $J bench latency --preset llama3-8b --batch 1 --input-len 512 \
          --output-len 128 --kv-cache-gb 8 --decode-steps 8 2>&1 | grep "per-token"
      done
    done
    XLA_FLAGS="$graphs --xla_gpu_graph_min_graph_size=1" python3 $REPO/bench/host_overhead.py \
      --preset llama3-8b --batch 1 --decode-steps 8 --top 12 2>&1 | grep -v "^WARNING" | tail -16 ;;
  throughput)
    $J bench throughput --preset llama3-8b --num-requests 64 --input-len 1024 --output-len 256 \
      --max-num-seqs 64 --max-num-batched-tokens 2048 --kv-cache-gb 24 --decode-steps $N \
      --record $OUT/RESULTS.md --json $OUT/throughput.json 2>&1 | grep -v "^WARNING" ;;
  serve)
    # The server's own warm-up would compile ~50 Llama-8B step shapes; a warm-up pass of
    # the load (other prompts, same lengths) compiles the ones this load uses instead.
    $J bench serve --preset llama3-8b --num-requests 64 --concurrency 64 --input-len 1024 \
      --output-len 256 --max-num-seqs 64 --max-num-batched-tokens 2048 --kv-cache-gb 24 \
      --max-model-len 1536 --decode-steps $N --no-server-warmup --record $OUT/RESULTS.md \
      --json $OUT/serve_c64.json 2>&1 | grep -v "^WARNING\|INFO:" ;;
  esac
done
