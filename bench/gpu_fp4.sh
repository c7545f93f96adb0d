#!/usr/bin/env bash
# The 4-bit weight kernels on the device: the dense and grouped quantized matmuls' GPU
# tests, then their kernel tables (fp4 and int4 dense, MXFP4 experts);
# logs and tables under $OUT.
#   device run: bash bench/gpu_fp4.sh [part...]   (parts: tests dense grouped sweep
#   gpt-oss llama qwen3 sequence; carry: .whl, from `pip wheel --no-deps . -w .whl`)
# sweep: the dense kernel's configurations (bench/quantized_matmul_sweep.py; more of its
# options in SWEEP_ARGS, e.g. "--splits 1,2 --share-sm 0,1"); gpt-oss: the
# gpt-oss-20b shape's batch-1 decode in bf16 and with MXFP4 experts (GPT_OSS_FORMATS);
# llama: the Llama-3-8B shape's batch-1 decode (LLAMA_FORMATS) beside the plain-torch peer
# (copy ../shared/peers into scratch/peers and carry it); qwen3: the Qwen3-30B-A3B shape's
# (QWEN3_FORMATS); sequence: a decode token's kernels in order, as JSON (SEQUENCE_RUNS of
# preset:format).
source "$(dirname "$0")/device_env.sh"  # wheel -> /tmp/site, $OUT, $REPO, cd /tmp
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
for part in ${*:-tests dense grouped}; do
  case $part in
  tests)
    timeout -k 5 ${TEST_TIMEOUT:-240} python3 -m pytest "$REPO/tests/test_quantized_matmul.py" \
      "$REPO/tests/test_grouped_matmul_mosaic.py" -c "$REPO/pyproject.toml" --rootdir "$REPO" \
      -m gpu --import-mode=importlib -q -rs -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} \
      > "$OUT/fp4_tests.log" 2>&1
    grep -E "FAILED|ERROR|passed|failed" "$OUT/fp4_tests.log" | tail -25 ;;
  dense)
    timeout -k 5 150 python3 "$REPO/bench/quantized_matmul_kernels.py" --shapes llama \
      --ms 1,16 --formats mxfp4,nvfp4,int4,int4:g128 --force-kernel --no-stock --max-minutes 2 \
      --out "$OUT/fp4_dense.md" > "$OUT/fp4_dense.log" 2>&1
    grep -v "^WARNING" "$OUT/fp4_dense.md" 2>/dev/null || tail -20 "$OUT/fp4_dense.log" ;;
  grouped)
    timeout -k 5 150 python3 "$REPO/bench/grouped_matmul_kernels.py" --models gpt-oss \
      --quantize ${GROUPED_FORMAT:-mxfp4} --tokens ${GROUPED_TOKENS:-1,8,64} --no-mgpu \
      --max-minutes 2 --words32 \
      --out "$OUT/fp4_grouped.md" > "$OUT/fp4_grouped.log" 2>&1
    grep -v "^WARNING" "$OUT/fp4_grouped.md" 2>/dev/null || tail -20 "$OUT/fp4_grouped.log" ;;
  sweep)
    timeout -k 5 ${SWEEP_TIMEOUT:-260} python3 "$REPO/bench/quantized_matmul_sweep.py" \
      --shapes ${SWEEP_SHAPES:-decode} --formats ${SWEEP_FORMATS:-int4:g128,mxfp4} \
      --ms ${SWEEP_MS:-1} --wgs ${SWEEP_WGS:-1,2} --mma ${SWEEP_MMA:-wgmma,sync,words32} \
      --max-minutes ${SWEEP_MINUTES:-3.5} ${SWEEP_ARGS:-} --out "$OUT/sweep.md" > "$OUT/sweep.log" 2>&1
    grep -v "^WARNING" "$OUT/sweep.md" 2>/dev/null || tail -20 "$OUT/sweep.log" ;;
  gpt-oss)
    for fmt in ${GPT_OSS_FORMATS:-bf16 mxfp4}; do  # bf16: no --quantize
      timeout -k 5 240 python3 -m jaxinfer.cli.main bench latency --preset gpt-oss-20b \
        --batch 1 --input-len 512 --output-len 128 --kv-cache-gb 8 --decode-steps 32 \
        $([ $fmt = bf16 ] || echo --quantize $fmt) --json "$OUT/gpt_oss_$fmt.json" > "$OUT/gpt_oss_$fmt.log" 2>&1
      grep -v "^WARNING" "$OUT/gpt_oss_$fmt.log" | tail -6
    done ;;
  qwen3)  # quantizing 61 GB of random bf16 weights at load takes ~2 minutes
    for fmt in ${QWEN3_FORMATS:-int4:g128}; do
      timeout -k 5 360 python3 -m jaxinfer.cli.main bench latency --preset qwen3-30b-a3b \
        --batch 1 --input-len 512 --output-len 128 --kv-cache-gb 8 --decode-steps 32 \
        --quantize $fmt --json "$OUT/qwen3_${fmt//:/_}.json" > "$OUT/qwen3_${fmt//:/_}.log" 2>&1
      grep -v "^WARNING" "$OUT/qwen3_${fmt//:/_}.log" | tail -6
    done ;;
  sequence)  # each decode kernel of a token, in order (host_overhead.py --sequence)
    for run in ${SEQUENCE_RUNS:-llama3-8b:int4:g128 gpt-oss-20b:mxfp4}; do
      preset=${run%%:*} fmt=${run#*:}
      timeout -k 5 240 python3 "$REPO/bench/host_overhead.py" --preset $preset --batch 1 \
        --ctx 512 --decode-steps 32 --steps 2 --quantize $fmt --sequence 300 \
        --json "$OUT/sequence_${preset}_${fmt//:/_}.json" > "$OUT/sequence_$preset.log" 2>&1
      grep -v "^WARNING" "$OUT/sequence_$preset.log" | tail -2
    done ;;
  llama)
    for fmt in ${LLAMA_FORMATS:-bf16 int4:g128}; do
      timeout -k 5 240 python3 -m jaxinfer.cli.main bench latency --preset llama3-8b \
        --batch 1 --input-len 512 --output-len 128 --kv-cache-gb 8 --decode-steps 32 \
        $([ $fmt = bf16 ] || echo --quantize $fmt) --json "$OUT/llama_${fmt//:/_}.json" \
        > "$OUT/llama_${fmt//:/_}.log" 2>&1
      grep -v "^WARNING" "$OUT/llama_${fmt//:/_}.log" | tail -6
    done
    [ -f "$REPO/scratch/peers/torch_decode.py" ] && timeout -k 5 300 python3 \
      "$REPO/scratch/peers/torch_decode.py" --input-len 512 --output-len 128 \
      --formats ${PEER_FORMATS:-bf16,int4} 2>&1 | grep -v "^WARNING" | tail -4 | tee "$OUT/torch_peer.log" ;;
  esac
done
