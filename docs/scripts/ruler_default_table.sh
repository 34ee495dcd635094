#!/usr/bin/env bash
# The ruler suite on the embedded default model (SmolLM2-135M-Instruct, CPU, torch backend) in every KV
# format with unit and calibrated scales; prints the table of docs/accuracy.md ("Default model by length").
# Usage: OUT=runs/ruler-table bash docs/scripts/ruler_default_table.sh [extra kvbench eval flags, e.g. --device cuda]
# (LENGTHS, TASKS, DEPTHS, LIMIT, MAX_MODEL_LEN override the defaults below)
set -u
OUT=${OUT:-runs/ruler-table}
LENGTHS=${LENGTHS:-1024,2048,4096}
TASKS=${TASKS:-niah_single,niah_multikey,niah_multivalue,niah_multiquery}
DEPTHS=${DEPTHS:-3}
LIMIT=${LIMIT:-1}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-8192}
mkdir -p "$OUT"
for cfg in bf16:unit fp8_e4m3:unit fp8_e4m3:calibrate fp8_e5m2:unit fp8_e5m2:calibrate nvfp4:unit nvfp4:calibrate; do
  kv=${cfg%%:*}; sc=${cfg##*:}
  dir="$OUT/$kv-$sc"
  [ -f "$dir/summary.json" ] && continue
  start=$(date +%s)
  kvbench eval --suite ruler --kv-dtype "$kv" --kv-scales "$sc" --max-model-len "$MAX_MODEL_LEN" --kv-budget-gb 0.5 \
      --context-lengths "$LENGTHS" --ruler-tasks "$TASKS" --depths "$DEPTHS" --limit "$LIMIT" --max-tokens 48 \
      --concurrency 8 --no-progress --out "$dir" "$@" >"$OUT/$kv-$sc.log" 2>&1
  echo "$kv $sc: exit $?, $(( $(date +%s) - start )) s"
done
python3 docs/scripts/ruler_table.py "$OUT"
