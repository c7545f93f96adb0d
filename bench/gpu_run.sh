#!/usr/bin/env bash
# The headline benchmarks on the device: kernels, Llama-3-8B latency and throughput, HF
# transformers on the same shapes, and where a batch-1 decode step's kernel time goes; logs
# under $OUT.
#   device run: bash bench/gpu_run.sh   (carry: .whl, built with `pip wheel --no-deps . -w .whl`)
source "$(dirname "$0")/device_env.sh"  # wheel -> /tmp/site, $OUT, $REPO, cd /tmp
J="python3 -m jaxinfer.cli.main"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
python3 -c 'import jax; print(jax.__version__, jax.devices())'
$J bench kernels --record "$OUT/RESULTS.md" --json "$OUT/kernels.json" 2>&1 | grep -v "^WARNING"
$J bench latency --preset llama3-8b --batch 1 --input-len 512 --output-len 128 --kv-cache-gb 8 \
  --record "$OUT/RESULTS.md" --json "$OUT/latency_b1.json" 2>&1 | grep -v "^WARNING"
$J bench throughput --preset llama3-8b --num-requests 16 --input-len 256 --output-len 128 \
  --max-num-seqs 16 --max-num-batched-tokens 512 --kv-cache-gb 8 \
  --record "$OUT/RESULTS.md" --json "$OUT/throughput.json" 2>&1 | grep -v "^WARNING"
python3 $REPO/bench/hf_transformers_latency.py --preset llama3-8b --batch 1 --input-len 512 \
  --output-len 128 2>&1 | tee "$OUT/hf_b1.log" | tail -1
python3 $REPO/bench/hf_transformers_latency.py --preset llama3-8b --batch 16 --input-len 256 \
  --output-len 128 2>&1 | tee "$OUT/hf_b16.log" | tail -1
python3 $REPO/bench/host_overhead.py --preset llama3-8b --batch 1 --ctx 576 --decode-steps 1 \
  --top 15 2>&1 | tee "$OUT/breakdown.log" | grep -v "^WARNING"
