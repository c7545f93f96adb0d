#!/usr/bin/env bash
# Sharding on a 2-GPU (or 4-GPU) machine: the GPU sharding tests, the memory planner against
# real allocation (bench/memory_plan_check.py), and decode at batch 1 and 64 for the
# Llama-3-8B shape at tp=1 / tp=2 (/ tp=4), and a MoE shape at ep=1 / ep=2.
#   device run (kind nvidia-h200-x2): bash bench/gpu_shard.sh [part...]   (carry: .whl)
#   parts: tests plan dense steps profile sequence flags allreduce processes moe
source "$(dirname "$0")/device_env.sh"  # wheel -> /tmp/site, $OUT, $REPO, cd /tmp
export JAXINFER_CACHE=/tmp/jxcache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
NGPU=$(nvidia-smi -L | wc -l)
latency() {  # preset mesh batch tag
  timeout -k 5 280 python3 -m jaxinfer.cli.main bench latency --preset "$1" --mesh "$2" \
    --batch "$3" --input-len 512 --output-len 128 --kv-cache-gb 16 --max-num-seqs 64 \
    --decode-steps "${DECODE_STEPS:-8}" --record "$OUT/RESULTS.md" --json "$OUT/$4.json" \
    > "$OUT/$4.log" 2>&1
  echo "$4: $(grep -h 'per-token' "$OUT/$4.log" || tail -3 "$OUT/$4.log")"
}
for part in ${*:-tests plan dense moe}; do
  case $part in
  tests)
    timeout -k 5 200 python3 -m pytest "$REPO/tests/test_sharding.py" "$REPO/tests/test_engine.py" -c "$REPO/pyproject.toml" \
      --rootdir "$REPO" -m gpu --import-mode=importlib -q -rs -p no:cacheprovider \
      > "$OUT/gpu_tests.log" 2>&1
    tail -4 "$OUT/gpu_tests.log" ;;
  plan)
    for mesh in tp=1 tp=$NGPU; do
      timeout -k 5 200 python3 "$REPO/bench/memory_plan_check.py" --preset llama3-8b --mesh "$mesh" \
        >> "$OUT/plan.log" 2>&1
    done
    grep -v "^WARNING" "$OUT/plan.log" | tail -30 ;;
  dense)  # DENSE_BATCHES="1" for batch 1 only
    for b in ${DENSE_BATCHES:-1 64}; do
      latency llama3-8b tp=1 $b llama_tp1_b$b
      latency llama3-8b tp=2 $b llama_tp2_b$b
      [ "$NGPU" -ge 4 ] && latency llama3-8b tp=4 $b llama_tp4_b$b
    done ;;
  profile)  # where a tp=2 batch-1 decode step's time goes (kernel time per device)
    timeout -k 5 200 python3 "$REPO/bench/host_overhead.py" --preset llama3-8b --batch 1 \
      --decode-steps 8 --mesh tp=2 --top 20 --json "$OUT/overhead_tp2.json" \
      > "$OUT/overhead_tp2.log" 2>&1; grep -v "^WARNING" "$OUT/overhead_tp2.log" | tail -24 ;;
  steps)  # the host wall time of each engine step of the batch-1 latency workload, tp=1,
    # without and after measuring the ceilings (CUPTI) in the same process
    for first in "" --ceilings-first; do
      timeout -k 5 150 python3 "$REPO/bench/step_times.py" --preset llama3-8b --mesh tp=1 \
        $first > "$OUT/steps_tp1$first.log" 2>&1
      echo "${first:-plain}: $(grep -h '^total' "$OUT/steps_tp1$first.log" || tail -2 "$OUT/steps_tp1$first.log")"
    done ;;
  sequence)  # every kernel of a batch-1 decode token in order (CUPTI), tp=1 and tp=2
    for tp in ${SEQUENCE_TPS:-1 2}; do
      timeout -k 5 200 python3 "$REPO/bench/host_overhead.py" --preset llama3-8b \
        --batch 1 --decode-steps 8 --mesh tp=$tp --top 12 --sequence 2000 \
        --json "$OUT/seq_tp$tp.json" > "$OUT/seq_tp$tp.log" 2>&1
      echo "tp=$tp: $(grep -h 'ms/token' "$OUT/seq_tp$tp.log" || tail -3 "$OUT/seq_tp$tp.log")"
    done ;;
  flags)  # tp=2 batch-1 decode (CUPTI, as profile) under each XLA / engine option tried;
    # FLAG_VARIANTS="tag ..." runs only those
    run_profile() {  # tag, then the environment to run it under
      local tag=$1; shift
      [ -n "$FLAG_VARIANTS" ] && [[ " $FLAG_VARIANTS " != *" $tag "* ]] && return
      env "$@" timeout -k 5 200 python3 "$REPO/bench/host_overhead.py" --preset llama3-8b \
        --batch 1 --decode-steps 8 --mesh "${MESH:-tp=2}" --top 12 --json "$OUT/flags_$tag.json" \
        > "$OUT/flags_$tag.log" 2>&1
      echo "$tag: $(grep -h 'ms/token' "$OUT/flags_$tag.log" || tail -3 "$OUT/flags_$tag.log")"
    }
    sync=--xla_gpu_disable_async_collectives=ALLREDUCE
    graphs="--xla_gpu_enable_command_buffer=+COLLECTIVES"
    run_profile default X=1
    run_profile graph_collectives XLA_FLAGS="$graphs --xla_gpu_graph_min_graph_size=1"
    run_profile graph_while \
      XLA_FLAGS="$graphs,+WHILE,+CONDITIONAL --xla_gpu_graph_min_graph_size=1"
    run_profile collective_kernels XLA_FLAGS=--xla_gpu_experimental_use_collective_kernels=ALL_REDUCE
    run_profile sync XLA_FLAGS="$sync"
    run_profile sync_graphs XLA_FLAGS="$sync $graphs"
    run_profile sync_graphs_min1 XLA_FLAGS="$sync $graphs --xla_gpu_graph_min_graph_size=1"
    MESH=tp=1 run_profile tp1 X=1 ;;
  processes)  # batch-1 tp=2 decode: one process for both GPUs, then one process per GPU
    mpd() {  # log tag, then the script's arguments
      local tag=$1; shift
      timeout -k 5 200 python3 "$REPO/bench/multiprocess_decode.py" --mesh tp=2 "$@" \
        > "$OUT/processes_$tag.log" 2>&1
      echo "$tag (rc $?): $(grep -h 'ms / token' "$OUT/processes_$tag.log" || tail -2 "$OUT/processes_$tag.log")"
    }
    mpd one
    for i in 0 1; do
      CUDA_VISIBLE_DEVICES=$i mpd "two_$i" --coordinator 127.0.0.1:12355 --num-processes 2 \
        --process-id $i &
    done; wait ;;
  allreduce)  # one all-reduce's latency inside a step under each XLA / NCCL option tried
    for flags in "" --xla_gpu_experimental_use_collective_kernels=ALL_REDUCE \
        --xla_gpu_disable_async_collectives=ALLREDUCE --xla_gpu_enable_nccl_user_buffers=true \
        --xla_gpu_experimental_enable_nccl_symmetric_buffers=true \
        "--xla_gpu_experimental_enable_nccl_symmetric_buffers=true --xla_gpu_disable_async_collectives=ALLREDUCE"; do
      echo "XLA_FLAGS=$flags"
      XLA_FLAGS=$flags timeout -k 5 120 python3 "$REPO/bench/allreduce_latency.py" --tokens 1 64 \
        2>&1 | grep -v "^WARNING" | tail -2 | tee -a "$OUT/allreduce.log"
    done
    echo "NCCL_PROTO=LL"
    NCCL_PROTO=LL timeout -k 5 120 python3 "$REPO/bench/allreduce_latency.py" --tokens 1 64 \
      2>&1 | grep -v "^WARNING" | tail -2 | tee -a "$OUT/allreduce.log" ;;
  moe)
    latency qwen3-30b-a3b ep=1 1 moe_ep1_b1
    latency qwen3-30b-a3b ep=2 1 moe_ep2_b1 ;;
  esac
done
