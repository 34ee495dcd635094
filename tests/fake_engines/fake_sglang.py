"""A fake SGLang server for conformance tests (loopback only, no GPU, starts in about a second).

Run it like ``python -m sglang.launch_server``: ``python tests/fake_engines/fake_sglang.py --model-path DIR
--kv-cache-dtype fp8_e4m3 --prefill-attention-backend triton --decode-attention-backend flashinfer --tp-size 1
--max-running-requests 4 --enable-metrics --host 127.0.0.1 --port 30000``.  It takes SGLang's flag names and
choices for what a sweep sets (``python/sglang/srt/server_args.py``: ``--kv-cache-dtype`` auto | fp8_e5m2 |
fp8_e4m3 | bf16 | bfloat16 | fp4_e2m1, the attention backend list, ``--reasoning-parser`` names) and, like
argparse, exits 2 with usage for an unknown flag or a bad choice.  ``DIR`` must hold a ``config.json``
(layers, KV heads, head dim, max positions); any other path fails in about a second with the error
transformers gives for a missing model.

It prints ``FAKE_ARGS {json}`` (the parsed flags), SGLang's start-up lines (``server_args=ServerArgs(...)``,
per TP rank ``KV Cache is allocated. #tokens: N, K size: .. GB, V size: .. GB``, rank 0's
``max_total_num_tokens=.., chunked_prefill_size=.., max_prefill_tokens=.., max_running_requests=..,
context_len=.., available_gpu_mem=.. GB``, ``The server is fired up and ready to roll!``) with the KV pool
derived from the flags (an fp8 KV cache holds twice the tokens of bf16 in the same memory), and serves
``GET /health``, ``GET /v1/models`` (``max_model_len``), ``GET|POST /flush_cache``, ``GET /metrics`` (only with
``--enable-metrics``: ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage``,
``sglang:num_used_tokens``, ``sglang:max_total_num_tokens``, ``sglang:num_retracted_requests_total``,
``cache_config_info{page_size,num_pages}``), ``/v1/chat/completions`` and ``/v1/completions``
(``reasoning_content`` apart with ``--reasoning-parser``; errors ``{"object": "error", "message", "type",
"param", "code"}``).  ``FAKE_SGLANG_STYLE=legacy`` prints the older lines (every rank prints
``max_total_num_tokens=.., max_prefill_tokens=.., max_running_requests=.., context_len=..``, no ``#tokens``
allocation line).  See ``fake_common`` for outputs and the environment knobs.

Sources (SGLang's public tree, 2024-2025): ``python/sglang/srt/entrypoints/http_server.py`` (``/health``
answers 200 without generating, ``/health_generate``, ``@app.api_route("/flush_cache", methods=["GET",
"POST"])`` answering 200, or 400 while requests run or wait), ``python/sglang/srt/entrypoints/openai/protocol.py``
(``ModelCard`` with ``owned_by="sglang"`` and ``max_model_len``; ``ErrorResponse`` flat; ``DeltaMessage``
``reasoning_content``), ``python/sglang/srt/metrics/collector.py`` (metric names), the start-up lines as cited
in ``harness/server_capacity.py``.  The final usage chunk (``choices: []``, ``usage``) follows
``stream_options.include_usage`` as in vLLM.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fake_common import (EngineStyle, Scheduler, build_app, emit, fail_model_path, fake_args_line,  # noqa: E402
                         kv_budget_bytes, load_model, serve, stamp)

KV_DTYPES = ["auto", "fp8_e5m2", "fp8_e4m3", "bf16", "bfloat16", "fp4_e2m1"]
ATTENTION_BACKENDS = ["triton", "torch_native", "flex_attention", "nsa", "cutlass_mla", "fa3", "fa4", "flashinfer", "flashmla",
                      "trtllm_mla", "trtllm_mha", "dual_chunk_flash_attn", "aiter", "wave", "intel_amx", "ascend", "intel_xpu"]
REASONING_PARSERS = ["deepseek-r1", "deepseek-v3", "glm45", "gpt-oss", "kimi", "kimi_k2", "qwen3", "qwen3-thinking", "step3",
                     "minimax", "minimax-append-think", "interns1"]
DTYPES = ["auto", "half", "float16", "bfloat16", "float", "float32"]
DEFAULT_MEM_FRACTION = 0.88
GB = 2**30


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launch_server.py")
    p.add_argument("--model-path", "--model", required=True)
    p.add_argument("--tokenizer-path")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", "--tp", "--tensor-parallel-size", type=int, default=1, dest="tp_size")
    p.add_argument("--dp-size", "--dp", "--data-parallel-size", type=int, default=1, dest="dp_size")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_DTYPES)
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS)
    p.add_argument("--prefill-attention-backend", choices=ATTENTION_BACKENDS)
    p.add_argument("--decode-attention-backend", choices=ATTENTION_BACKENDS)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--max-running-requests", type=int)
    p.add_argument("--max-total-tokens", type=int)
    p.add_argument("--context-length", type=int)
    p.add_argument("--chunked-prefill-size", type=int)
    p.add_argument("--max-prefill-tokens", type=int, default=16384)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--quantization")
    p.add_argument("--quantization-param-path")
    p.add_argument("--served-model-name")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS)
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--enable-cache-report", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--skip-server-warmup", action="store_true")
    p.add_argument("--cuda-graph-max-bs", type=int)
    p.add_argument("--schedule-policy", default="fcfs", choices=["lpm", "random", "fcfs", "dfs-weight", "lof", "priority"])
    p.add_argument("--random-seed", type=int)
    p.add_argument("--base-gpu-id", type=int, default=0)
    p.add_argument("--api-key")
    p.add_argument("--log-level", default="info")
    return p


def main(argv: list[str]) -> None:
    args = parser().parse_args(argv)
    legacy = os.environ.get("FAKE_SGLANG_STYLE") == "legacy"
    emit(fake_args_line("sglang", args, argv))
    model = load_model(args.model_path)
    if model is None:
        fail_model_path([
            "Traceback (most recent call last):",
            '  File "sglang/launch_server.py", line 14, in <module>',
            "    launch_server(server_args)",
            f"OSError: {args.model_path} is not a local folder and is not a valid model identifier listed on "
            "'https://huggingface.co/models'",
        ])
    kv = "bf16" if args.kv_cache_dtype in ("auto", "bfloat16") else args.kv_cache_dtype
    context_len = args.context_length or model.max_len
    frac = args.mem_fraction_static or DEFAULT_MEM_FRACTION
    bpt = model.bytes_per_token(kv)
    tokens = args.max_total_tokens or int(kv_budget_bytes(frac, DEFAULT_MEM_FRACTION, args.tp_size) // bpt)
    tokens -= tokens % args.page_size
    max_running = args.max_running_requests or min(4096, max(1, tokens // 2))
    chunked = args.chunked_prefill_size or 8192
    emit(f"[{stamp()}] server_args=ServerArgs(model_path='{args.model_path}', tokenizer_path='{args.tokenizer_path or args.model_path}', "
         f"dtype='{args.dtype}', kv_cache_dtype='{args.kv_cache_dtype}', mem_fraction_static={frac}, "
         f"max_running_requests={args.max_running_requests}, chunked_prefill_size={chunked}, tp_size={args.tp_size}, "
         f"dp_size={args.dp_size}, page_size={args.page_size}, attention_backend={args.attention_backend!r}, "
         f"prefill_attention_backend={args.prefill_attention_backend!r}, decode_attention_backend={args.decode_attention_backend!r}, "
         f"reasoning_parser={args.reasoning_parser!r}, enable_metrics={args.enable_metrics})")
    per_rank_gb = tokens * bpt / args.tp_size / 2 / GB
    for rank in range(args.tp_size):
        tag = f"[{stamp()} TP{rank}]"
        emit(f"{tag} Load weight end. type={model.arch}, dtype=torch.bfloat16, avail mem=70.00 GB, mem usage=1.00 GB.")
        if legacy:
            emit(f"{tag} Memory pool end. avail mem=8.00 GB")
            emit(f"{tag} max_total_num_tokens={tokens}, max_prefill_tokens={args.max_prefill_tokens}, "
                 f"max_running_requests={max_running}, context_len={context_len}")
        else:
            emit(f"{tag} KV Cache is allocated. #tokens: {tokens}, K size: {per_rank_gb:.2f} GB, V size: {per_rank_gb:.2f} GB")
            emit(f"{tag} Memory pool end. avail mem=8.00 GB")
    if not legacy:
        emit(f"[{stamp()} TP0] max_total_num_tokens={tokens}, chunked_prefill_size={chunked}, "
             f"max_prefill_tokens={args.max_prefill_tokens}, max_running_requests={max_running}, "
             f"context_len={context_len}, available_gpu_mem=8.00 GB")
    sched = Scheduler(max_running, tokens, float(os.environ.get("FAKE_TOKEN_DELAY_S", "0.004")))
    served = args.served_model_name or args.model_path
    labels = (f'engine_type="unified",model_name="{served}",moe_ep_rank="0",pp_rank="0",tp_rank="0"')

    def metrics_text(s: Scheduler) -> str:
        gauges = [("num_running_reqs", s.running), ("num_used_tokens", s.used_tokens), ("token_usage", s.usage),
                  ("num_queue_reqs", s.waiting), ("max_total_num_tokens", tokens), ("num_retracted_reqs", 0)]
        out = []
        for name, v in gauges:
            out += [f"# HELP sglang:{name} {name}", f"# TYPE sglang:{name} gauge", f"sglang:{name}{{{labels}}} {float(v)}"]
        for name, v in (("num_retracted_requests", s.preemptions), ("prompt_tokens", s.prompt_tokens_total),
                        ("generation_tokens", s.generation_tokens_total), ("num_requests", s.finished)):
            out += [f"# TYPE sglang:{name}_total counter", f"sglang:{name}_total{{{labels}}} {float(v)}"]
        out += ["# TYPE cache_config_info gauge", f'cache_config_info{{num_pages="{tokens // args.page_size}",page_size="{args.page_size}"}} 1.0']
        return "\n".join(out) + "\n"

    def context_error(limit: int, prompt: int, new: int) -> str:
        return (f"Requested token count exceeds the model's maximum context length of {limit} tokens. You requested a "
                f"total of {prompt + new} tokens: {prompt} tokens from the input messages and {new} tokens for the "
                "completion. Please reduce the number of tokens in the input messages or the completion to fit within the limit.")

    style = EngineStyle(
        name="sglang", served_name=served, model_path=args.model_path, max_model_len=context_len,
        reasoning_fields=("reasoning_content",) if args.reasoning_parser else (),
        error_body=lambda msg, typ, code, param: {"object": "error", "message": msg, "type": typ, "param": param, "code": code},
        metrics_text=metrics_text, owned_by="sglang", metrics_enabled=args.enable_metrics,
        flush_route=(("GET", "POST"), "/flush_cache"), context_error=context_error)
    emit(f"[{stamp()}] INFO:     Uvicorn running on http://{args.host}:{args.port} (Press CTRL+C to quit)")
    emit(f"[{stamp()}] The server is fired up and ready to roll!")
    serve(build_app(style, sched), args.host, args.port)


if __name__ == "__main__":
    main(sys.argv[1:])
