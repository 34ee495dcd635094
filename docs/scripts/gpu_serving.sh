#!/usr/bin/env bash
# Serving comparison across KV formats on one GPU: kvbench serve (synthetic Llama-3-8B, triton backend,
# fixed 8 GiB KV budget) driven by kvbench load at several concurrency caps. Output: $OUT/serve-<kv>/.
# Usage: OUT=runs/gpu-serving bash docs/scripts/gpu_serving.sh [kv formats...]
set -u
OUT=${OUT:-runs/gpu-serving}
FORMATS=${*:-bf16 fp8_e4m3 nvfp4}
PORT=${PORT:-8011}
mkdir -p "$OUT"
for kv in $FORMATS; do
  log="$OUT/server-$kv.log"
  kvbench serve --model synthetic:llama-3-8b --kv-dtype "$kv" --kv-scales unit --backend triton \
      --kv-budget-gb 8 --max-running 256 --max-batched-tokens 8192 --max-model-len 2048 \
      --port "$PORT" >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 1 240); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
    kill -0 $pid 2>/dev/null || break
    sleep 1
  done
  if ! curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then
    echo "server for $kv did not come up"; tail -30 "$log"; kill $pid 2>/dev/null; continue
  fi
  grep -m1 "KV cache:" "$log"
  for c in 1 16 64 256; do
    n=$(( c < 8 ? 16 : 2 * c )); [ $c -ge 128 ] && n=$c
    kvbench load --base-url "http://127.0.0.1:$PORT" --max-concurrency $c --num-prompts $n \
        --input-len 1024 --output-len 128 --no-progress --salt "$kv-$c" --out "$OUT/serve-$kv" \
        | sed -n '/Serving Benchmark Result/,/^=\+$/p'
  done
  kill $pid; wait $pid 2>/dev/null
done
