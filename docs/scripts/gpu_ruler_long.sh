#!/usr/bin/env bash
# The ruler suite at 32k and 128k tokens on one GPU: synthetic Llama-3-8B (random weights, full depth, the
# byte tokenizer), Triton backend, one niah_single item per length, in bf16, fp8_e4m3 and nvfp4 KV.
# Random weights answer nothing: this checks that long prompts prefill (chunked across the step budget) and
# decode without running out of memory, and times each length (the item's latency_s).
# max_position_embeddings is raised from 131072 so that a 131072-token prompt leaves room for the answer.
# Usage: OUT=runs/gpu-ruler bash docs/scripts/gpu_ruler_long.sh [kv formats...]
set -u
OUT=${OUT:-runs/gpu-ruler}
FORMATS=${*:-bf16 fp8_e4m3 nvfp4}
mkdir -p "$OUT"
nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader -l 1 >"$OUT/gpu-mem.csv" 2>/dev/null &
smi=$!
for kv in $FORMATS; do
  start=$(date +%s)
  kvbench eval --suite ruler --model synthetic:llama-3-8b,max_position_embeddings=131328 --device cuda \
      --backend triton --kv-dtype "$kv" --kv-scales unit --kv-budget-gb 20 --max-model-len 131328 \
      --max-batched-tokens 8192 --context-lengths 32k,128k --ruler-tasks niah_single --depths 1 --limit 1 \
      --prompt-style completion --max-tokens 16 --concurrency 1 --no-progress --out "$OUT/ruler-$kv" \
      >"$OUT/eval-$kv.log" 2>&1
  rc=$?
  echo "== $kv: exit $rc, $(( $(date +%s) - start )) s wall (model set-up included)"
  grep -m1 "KV cache:" "$OUT/eval-$kv.log"
  [ $rc -ne 0 ] && tail -20 "$OUT/eval-$kv.log"
  python3 - "$OUT/ruler-$kv/items.jsonl" <<'PY'
import json, sys
try:
    rows = [json.loads(l) for l in open(sys.argv[1])]
except FileNotFoundError:
    rows = []
for r in rows:
    print(f"  L={r['context_length']:>6} tokens={r['context_tokens']:>6} finish={r['finish_reason']:<6} "
          f"out_tokens={r['output_tokens']:>3} latency={r['latency_s']:.2f} s")
PY
done
kill $smi 2>/dev/null
sort -t, -k1 -n "$OUT/gpu-mem.csv" | tail -1 | sed 's/^/peak GPU memory used, total: /'
