#!/bin/bash
# kvbench's engine before / after a change, and vLLM, under the same load on one GPU (docs/performance.md
# "Host work per step").  On the GPU machine, from the checkout, after `python3 docs/scripts/vllm_gpu.py setup`
# (the bundle also brings fastapi/uvicorn for `kvbench serve`):
#
#   git archive <old-rev> core harness kernels runtime suites reports configs tools | (mkdir -p OLD && tar -x -C OLD)
#   bash docs/scripts/serving_ab.sh OLD [vllm]      # KV fp8_e4m3 (KV=bf16 for bf16), results in $OUT/res
#
# Each engine serves the Llama-3-8B shape (synthetic weights, vocabulary 49,152) with 40 GiB of KV; the load is
# `kvbench load`, random token-id prompts, 1024 in / 128 out, 4 warm-ups, c=64 (256 requests) and c=256 (512).
set -u
R=$PWD; OLD=$(cd "$1" && pwd); WITH=${2:-}; KV=${KV:-fp8_e4m3}; export PYTHONUNBUFFERED=1
W=${KVB_VLLM_WORK:-/tmp/kvb-vllm}; SITE=$W/vp/site; OUT=${OUT:-$W/out}; mkdir -p $OUT/res
mkdir -p /tmp/kvb-old/kvbench
for d in core harness kernels runtime suites reports configs tools; do ln -sfn $OLD/$d /tmp/kvb-old/kvbench/$d; done
load() { # name port concurrency requests
  PYTHONPATH=$W/kvb:$SITE timeout 300 python3 -m kvbench.harness load --base-url http://127.0.0.1:$2 --model llama8b \
    --max-concurrency $3 --num-prompts $4 --input-len 1024 --output-len 128 --dataset random --warmup 4 --no-progress \
    --tokenizer none --salt $KV-$3 --out $OUT/res/$1-c$3 > $OUT/res/$1-c$3.txt 2>&1
}
kvb() { # name package-root [serve flags...]
  local name=$1 root=$2; shift 2
  PYTHONPATH=$root:$SITE python3 -m kvbench.harness serve --model synthetic:llama-3-8b,vocab=49152 --served-model-name llama8b \
    --kv-dtype $KV --kv-scales unit --backend triton --kv-budget-gb 40 --max-running 256 --max-batched-tokens 8192 \
    --max-model-len 9216 --port 8190 "$@" > $OUT/res/$name.log 2>&1 &
  local sp=$!
  for _ in $(seq 240); do curl -sf http://127.0.0.1:8190/health >/dev/null && break; sleep 1; done
  load $name 8190 64 256; load $name 8190 256 512
  kill $sp; wait $sp 2>/dev/null
}
date -u
kvb old /tmp/kvb-old
kvb new $W/kvb
kvb mixed $W/kvb --mixed-prefill
if [ "$WITH" = vllm ]; then
  v=$([ "$KV" = bf16 ] && echo bf16 || echo fp8); port=$([ "$v" = bf16 ] && echo 8101 || echo 8102)
  python3 docs/scripts/vllm_gpu.py --out $OUT/vllm serve-vllm $v > $OUT/res/vllm-serve.txt 2>&1
  load vllm $port 64 256; load vllm $port 256 512
  python3 docs/scripts/vllm_gpu.py stop >/dev/null 2>&1
fi
date -u
python3 - "$OUT/res" <<'PY'
import glob, json, sys
print("| run | req/s | out tok/s | mean TTFT ms | mean TPOT ms | median ITL ms | failed |")
print("|---|---|---|---|---|---|---|")
for f in sorted(glob.glob(f"{sys.argv[1]}/*-c*/summary.json")):
    lv = json.load(open(f))["levels"][0]
    print(f"| {f.split('/')[-2]} | {lv['request_throughput']:.2f} | {lv['output_throughput']:,.0f} | {lv['mean_ttft_ms']:,.1f} | "
          f"{lv['mean_tpot_ms']:.2f} | {lv['median_itl_ms']:.2f} | {lv['failed']} |")
PY
