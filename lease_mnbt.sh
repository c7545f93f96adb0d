source bench/device_env.sh
J="python3 -m jaxinfer.cli.main"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
for n in 4096 2048 8192; do
  echo "== max_num_batched_tokens $n"
  timeout 150 $J bench throughput --preset llama3-8b --num-requests 512 --input-len 256 --output-len 256 \
    --max-num-batched-tokens $n 2>&1 | grep -v "^WARNING" | grep -E "output tokens/s|whole run|decode-only steps \("
done
