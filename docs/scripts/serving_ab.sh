#!/bin/bash
# kvbench's engine (before / after a change; steps launched ahead or not; with --mixed-prefill) and vLLM under the same load on one
# GPU (docs/performance.md "Host work per step").  On the GPU machine, from the checkout, after
# `python3 docs/scripts/vllm_gpu.py setup` (the bundle also brings fastapi/uvicorn for `kvbench serve`):
#
#   git archive <old-rev> core harness kernels runtime suites reports configs tools | (mkdir -p OLD && tar -x -C OLD)
#   bash docs/scripts/serving_ab.sh OLD [vllm]      # KV fp8_e4m3 (KV=bf16 for bf16), results in $OUT/res
#   ARMS="new mixed vllm" CONC="16 64 256" KV=bf16 bash docs/scripts/serving_ab.sh -   # no old tree
#
# SHAPES: input x output lengths (default "1024x128"; "1024x1" times prefill alone, "32x512" mostly decode).
# ARMS picks the arms (default "old new mixed", plus "vllm" when the second argument is vllm; "plain" is new with
# --no-overlap-schedule); CONC the
# concurrency levels (default "64 256"): 4 x the concurrency in requests up to 64 (at least 64), 2 x above (c=64: 256,
# c=256: 512, as before).  Each engine serves
# the Llama-3-8B shape (synthetic weights, vocabulary 49,152) with 40 GiB of KV; the load is `kvbench load`,
# random token-id prompts, 1024 in / 128 out, 4 warm-ups.
set -u
R=$PWD; WITH=${2:-}; KV=${KV:-fp8_e4m3}; export PYTHONUNBUFFERED=1
ARMS=${ARMS:-"old new mixed$([ "$WITH" = vllm ] && echo " vllm")"}; CONC=${CONC:-"64 256"}
W=${KVB_VLLM_WORK:-/tmp/kvb-vllm}; SITE=$W/vp/site; OUT=${OUT:-$W/out}; mkdir -p $OUT/res
if [ "$1" != - ]; then
  OLD=$(cd "$1" && pwd)
  mkdir -p /tmp/kvb-old/kvbench
  for d in core harness kernels runtime suites reports configs tools; do ln -sfn $OLD/$d /tmp/kvb-old/kvbench/$d; done
fi
load() { # name port concurrency input-len output-len
  local n=$(( $3 > 64 ? $3 * 2 : ($3 * 4 < 64 ? 64 : $3 * 4) )) tag=$KV-$1-c$3
  [ "$4x$5" != 1024x128 ] && tag=$tag-i$4o$5
  PYTHONPATH=$W/kvb:$SITE timeout 300 python3 -m kvbench.harness load --base-url http://127.0.0.1:$2 --model llama8b \
    --max-concurrency $3 --num-prompts $n --input-len $4 --output-len $5 --dataset random --warmup 4 --no-progress \
    --tokenizer none --salt $KV-$3-$4-$5 --out $OUT/res/$tag > $OUT/res/$tag.txt 2>&1
}
# SHAPES: input x output lengths per level (default 1024x128); 1024x1 times prefill alone, 32x512 mostly decode
# CONC_<arm> (e.g. CONC_plain="64") overrides CONC for one arm
levels() { local cs; eval "cs=\${CONC_$1:-\$CONC}"
  for sh in ${SHAPES:-1024x128}; do for c in $cs; do load $1 $2 $c ${sh%x*} ${sh#*x}; done; done; }
kvb() { # name package-root [serve flags...]
  local name=$1 root=$2; shift 2
  PYTHONPATH=$root:$SITE python3 -m kvbench.harness serve --model synthetic:llama-3-8b,vocab=49152 --served-model-name llama8b \
    --kv-dtype $KV --kv-scales unit --backend triton --kv-budget-gb 40 --max-running 256 --max-batched-tokens 8192 \
    --max-model-len 9216 --port 8190 "$@" > $OUT/res/$KV-$name.log 2>&1 &
  local sp=$!
  for _ in $(seq 240); do curl -sf http://127.0.0.1:8190/health >/dev/null && break; sleep 1; done
  levels $name 8190
  kill $sp; wait $sp 2>/dev/null
}
date -u
for arm in $ARMS; do
  case $arm in
    old) kvb old /tmp/kvb-old ;;
    new) kvb new $W/kvb ;;
    mixed) kvb mixed $W/kvb --mixed-prefill ;;
    plain) kvb plain $W/kvb --no-overlap-schedule ;;  # each step waits for the last one's tokens
    vllm)
      v=$([ "$KV" = bf16 ] && echo bf16 || echo fp8); port=$([ "$v" = bf16 ] && echo 8101 || echo 8102)
      python3 docs/scripts/vllm_gpu.py --out $OUT/vllm serve-vllm $v > $OUT/res/$KV-vllm-serve.txt 2>&1
      levels vllm $port
      python3 docs/scripts/vllm_gpu.py stop >/dev/null 2>&1 ;;
    *) echo "unknown arm $arm (old, new, mixed, plain, vllm)" >&2; exit 2 ;;
  esac
done
date -u
python3 - "$OUT/res" <<'PY'
import glob, json, sys
print("| run | req/s | in+out tok/s | mean TTFT ms | mean TPOT ms | median ITL ms | max ITL ms | kernel compiles | "
      "busy | prefill steps ms (tok) | mixed steps ms (tok) | decode steps ms (rows) | failed |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
def steps(es, kind):  # kvbench's server only: ms per step and tokens per step of one kind
    k = (es or {}).get(kind)
    return f"{k['ms_per_step']:.2f} ({k['tokens'] / k['steps']:.0f})" if k else ""
for f in sorted(glob.glob(f"{sys.argv[1]}/*-c*/summary.json")):
    lv = json.load(open(f))["levels"][0]
    sm = lv.get("server_metrics") or {}
    comp, es = sm.get("kernel_compiles"), sm.get("engine_steps")
    busy = f"{es['busy_fraction']:.2f}" if es and es.get("busy_fraction") is not None else ""
    v = lambda key, spec: "" if lv.get(key) is None else format(lv[key], spec)  # no TPOT / ITL at one output token
    print(f"| {f.split('/')[-2]} | {v('request_throughput', '.2f')} | {v('total_token_throughput', ',.0f')} | "
          f"{v('mean_ttft_ms', ',.1f')} | {v('mean_tpot_ms', '.2f')} | {v('median_itl_ms', '.2f')} | {v('max_itl_ms', ',.0f')} | "
          f"{'' if comp is None else comp} | {busy} | {steps(es, 'prefill')} | {steps(es, 'mixed')} | "
          f"{steps(es, 'decode')} | {lv['failed']} |")
PY
