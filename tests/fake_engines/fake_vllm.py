"""A fake vLLM OpenAI server for conformance tests (loopback only, no GPU, starts in about a second).

Run it like ``vllm serve``: ``python tests/fake_engines/fake_vllm.py serve DIR --kv-cache-dtype fp8
--attention-backend FLASHINFER --tensor-parallel-size 1 --max-num-seqs 4 --host 127.0.0.1 --port 8000``.
It takes vLLM's flag names and choices for what a sweep sets (``vllm/config/cache.py`` ``CacheDType``: auto |
bfloat16 | fp8 | fp8_e4m3 | fp8_e5m2 | fp8_inc | fp8_ds_mla; ``--block-size``; ``--attention-backend`` names,
case-insensitive, or ``VLLM_ATTENTION_BACKEND``; ``--reasoning-parser`` names) and, like argparse, exits 2
with usage for an unknown flag or a bad choice.  ``DIR`` must hold a ``config.json``; any other path fails
in about a second with vLLM's "Invalid repository ID or local directory" error.

``--kv-cache-dtype-skip-layers`` (vLLM PR 33695; ``CacheConfig.kv_cache_dtype_skip_layers: list[str]``, so
argparse ``nargs="+"``) takes layer indices and ``sliding_window`` as separate words; the skipped layers hold
the model's dtype in the KV pool.  vLLM ignores any other word silently; the fake refuses it (exit 2), so a
launch that renders a range or a comma list fails here instead of quietly running uniform.

It prints ``FAKE_ARGS {json}``, vLLM's start-up lines with the KV pool derived from the flags (fp8 holds
twice the tokens of bf16): ``Initializing a V1 LLM engine (vX) with config: ... max_seq_len=..,
tensor_parallel_size=.., kv_cache_dtype=..``, per worker ``Available KV cache memory: X GiB``, ``GPU KV cache
size: N tokens``, ``Maximum concurrency for L tokens per request: X.XXx``, ``Engine 000: vllm cache_config_info
with initialization after num_gpu_blocks is: N``; and serves ``GET /health``, ``GET /v1/models``
(``max_model_len``; an unknown ``model`` in a request is a 404), ``POST /tokenize``, ``GET /metrics``
(``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``,
``vllm:num_preemptions_total``, ``vllm:cache_config_info{block_size,cache_dtype,num_gpu_blocks}``),
``POST /reset_prefix_cache`` (only with ``VLLM_SERVER_DEV_MODE=1``, as in vLLM; 404 otherwise) and the two
completion routes.

``FAKE_VLLM_STYLE`` picks which generation of vLLM it imitates (boundaries approximate):
``legacy`` (V0 engine: ``# GPU blocks: N, # CPU blocks: M``, ``Maximum concurrency for 4096 tokens ..``,
``vllm:gpu_cache_usage_perc``, flat errors ``{"object": "error", "message", "type", "param", "code"}``,
``reasoning_content``, ``--enable-reasoning`` accepted); ``v1`` (V1 engine lines, nested errors ``{"error":
{"message", "type", "param", "code"}}``, both ``reasoning_content`` and ``reasoning``, both KV usage gauges);
``latest`` (the default: as ``v1`` but only ``reasoning``, only ``vllm:kv_cache_usage_perc``, coloured log
levels).

Sources (vLLM's public tree): ``vllm/entrypoints/openai/api_server.py`` (``/health``, ``/tokenize``,
``/v1/models``; ``/reset_prefix_cache`` registered only under ``VLLM_SERVER_DEV_MODE``, later in
``vllm/entrypoints/serve/cache/api_router.py``), ``vllm/entrypoints/openai/protocol.py`` (``ErrorResponse`` flat
with ``object: "error"``, later ``{"error": ErrorInfo}``; ``ModelCard.max_model_len``; ``StreamOptions``;
``DeltaMessage`` with ``reasoning_content``, then ``reasoning`` beside it, then ``reasoning`` alone in
``vllm/entrypoints/openai/engine/protocol.py``), ``vllm/v1/metrics/loggers.py`` (metric names,
``log_metrics_info("cache_config", ...)``), ``vllm/config/cache.py`` (``CacheDType``, ``BlockSize``); the
start-up lines as cited in ``harness/server_capacity.py``.  Usage comes as a last chunk with ``choices: []``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fake_common import (EngineStyle, Scheduler, build_app, emit, fail_model_path, fake_args_line,  # noqa: E402
                         kv_budget_bytes, load_model, serve)

KV_DTYPES = ["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla"]
BACKENDS = ["FLASH_ATTN", "TRITON_ATTN", "XFORMERS", "ROCM_ATTN", "ROCM_AITER_FA", "TORCH_SDPA", "FLASHINFER", "TRITON_MLA",
            "CUTLASS_MLA", "FLASHMLA", "FLASH_ATTN_MLA", "FLASHINFER_MLA", "FLEX_ATTENTION", "TREE_ATTN", "CPU_ATTN",
            "PALLAS", "NO_ATTENTION"]
REASONING_PARSERS = ["deepseek_r1", "deepseek_v3", "qwen3", "granite", "glm45", "openai_gptoss", "mistral", "hunyuan_a13b",
                     "step3", "seed_oss", "minimax_m2", "ernie45"]
VERSIONS = {"legacy": "0.6.6", "v1": "0.11.0", "latest": "0.26.0"}
DEFAULT_GPU_UTIL = 0.9
GiB = 2**30


def _max_len(s: str) -> int:
    s = s.strip().lower()
    mult = {"k": 1000, "m": 1000**2}.get(s[-1:], 1)
    try:
        return int(float(s[:-1] if mult > 1 else s) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid max model length {s!r}") from None


def _skip_layer(s: str) -> str:
    if s.isdigit() or s == "sliding_window":
        return s
    raise argparse.ArgumentTypeError(f"invalid skip layer {s!r} (a layer index or sliding_window)")


def kv_bytes_per_token(model, kv: str, skip: list[str]) -> float:
    """Bytes per token of the KV pool: skipped layers (indices; the fake models have no sliding windows) in the
    model's dtype, the others in ``kv``."""
    n_skip = len({int(x) for x in skip if x.isdigit() and int(x) < model.layers})
    return model.bytes_per_token(kv) * (model.layers - n_skip) / model.layers + model.bytes_per_token("auto") * n_skip / model.layers


def parser(style: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm")
    sub = p.add_subparsers(dest="subcommand", required=True)
    s = sub.add_parser("serve", prog="vllm serve")
    s.add_argument("model_tag", nargs="?")
    s.add_argument("--model")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    s.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    s.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    s.add_argument("--kv-cache-dtype", default="auto", choices=KV_DTYPES)
    s.add_argument("--calculate-kv-scales", action="store_true")
    s.add_argument("--kv-cache-dtype-skip-layers", nargs="+", type=_skip_layer, default=[])
    s.add_argument("--max-model-len", type=_max_len)
    s.add_argument("--max-num-seqs", type=int)
    s.add_argument("--max-num-batched-tokens", type=int)
    s.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_GPU_UTIL)
    s.add_argument("--kv-cache-memory-bytes", type=int)
    s.add_argument("--load-format", default="auto", choices=["auto", "pt", "safetensors", "npcache", "dummy", "tensorizer",
                                                            "sharded_state", "gguf", "bitsandbytes", "mistral", "runai_streamer"])
    s.add_argument("--tokenizer")
    s.add_argument("--block-size", type=int, choices=[1, 8, 16, 32, 64, 128, 256])
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    s.add_argument("--attention-backend", type=str.upper, choices=BACKENDS)
    s.add_argument("--reasoning-parser", choices=REASONING_PARSERS)
    if style == "legacy":
        s.add_argument("--enable-reasoning", action="store_true")
    s.add_argument("--served-model-name", nargs="+")
    s.add_argument("--dtype", default="auto", choices=["auto", "half", "float16", "bfloat16", "float", "float32"])
    s.add_argument("--quantization", "-q")
    s.add_argument("--trust-remote-code", action="store_true")
    s.add_argument("--enforce-eager", action="store_true")
    s.add_argument("--seed", type=int)
    s.add_argument("--api-key")
    s.add_argument("--disable-log-requests", action="store_true")
    s.add_argument("--enable-log-requests", action="store_true")
    s.add_argument("--uvicorn-log-level", default="info")
    return p


def main(argv: list[str]) -> None:
    style = os.environ.get("FAKE_VLLM_STYLE", "latest")
    version = VERSIONS.get(style, VERSIONS["latest"])
    args = parser(style).parse_args(argv)
    path = args.model_tag or args.model
    if path is None:
        parser(style).parse_args(["serve", "--help"])
    legacy = style == "legacy"
    latest = style == "latest"  # vLLM 0.26.0's own lines (tests/fixtures/vllm-0.26/, from a real H200 run)
    level = "\x1b[32mINFO\x1b[0m" if style == "v1-colour" else "INFO"
    api = "" if legacy else f"(APIServer pid={os.getpid()}) "
    core = "" if legacy else (f"(EngineCore pid={os.getpid()}) " if latest else f"(EngineCore_DP0 pid={os.getpid()}) ")

    def info(prefix: str, where: str, msg: str) -> None:
        emit(f"{prefix}{level} 01-02 03:04:05 [{where}] {msg}" if not legacy else f"INFO 01-02 03:04:05 {where}] {msg}")

    emit(fake_args_line("vllm", args, argv))
    if latest:
        info(api, "api_utils.py:345", f" \u2584\u2584 \u2584\u2588 \u2588     \u2588     \u2588 \u2580\u2584\u2580 \u2588  version {version}")
    else:
        info(api, "api_server.py:1896", f"vLLM API server version {version}")
    if not legacy:
        defaults = vars(parser(style).parse_args(["serve"]))
        changed = {k: v for k, v in vars(args).items() if v != defaults.get(k) and k != "subcommand"}
        info(api, "api_utils.py:273" if latest else "utils.py:233", f"non-default args: {changed}")
    model = load_model(path)
    if model is None:
        fail_model_path([f"{api}Traceback (most recent call last):", f'{api}  File "vllm/entrypoints/cli/main.py", line 54, in main',
                         f"{api}ValueError: Invalid repository ID or local directory specified: '{path}'.",
                         "Please verify the following requirements:", "1. Provide a valid Hugging Face repository ID.",
                         "2. Specify a local directory that contains a recognized configuration file.",
                         "   - For Hugging Face models: ensure the presence of a 'config.json'.",
                         "   - For Mistral models: ensure the presence of a 'params.json'."])
    env_backend = os.environ.get("VLLM_ATTENTION_BACKEND")
    if env_backend and env_backend.upper() not in BACKENDS:
        fail_model_path([f"{core}ValueError: Invalid attention backend: '{env_backend}'. Valid backends are: {BACKENDS}"])
    backend = args.attention_backend or (env_backend.upper() if env_backend else "FLASH_ATTN")
    kv = "bfloat16" if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    max_len = args.max_model_len or model.max_len
    tp, pp, block = args.tensor_parallel_size, args.pipeline_parallel_size, args.block_size or 16
    budget = args.kv_cache_memory_bytes * tp * pp if args.kv_cache_memory_bytes else \
        kv_budget_bytes(args.gpu_memory_utilization, DEFAULT_GPU_UTIL, tp * pp)
    blocks = int(budget // (kv_bytes_per_token(model, kv, args.kv_cache_dtype_skip_layers) * block))
    tokens = blocks * block
    conc = tokens / max_len
    max_seqs = args.max_num_seqs or 256
    served = (args.served_model_name or [path])[0]
    engine = "an LLM engine" if legacy else "a V1 LLM engine"
    info(core, "core.py:77" if not legacy else "llm_engine.py:237",
         f"Initializing {engine} (v{version}) with config: model='{path}', speculative_config=None, tokenizer='{path}', "
         f"dtype=torch.bfloat16, max_seq_len={max_len}, download_dir=None, tensor_parallel_size={tp}, "
         f"pipeline_parallel_size={pp}, data_parallel_size={args.data_parallel_size}, quantization={args.quantization}, "
         f"enforce_eager={args.enforce_eager}, kv_cache_dtype={args.kv_cache_dtype}, device_config=cuda, seed={args.seed or 0}, "
         f"served_model_name={served}, enable_prefix_caching={args.enable_prefix_caching is not False}")
    info(core, "cuda.py:253", f"Using {backend} backend.")
    if legacy:
        info("", "gpu_executor.py:122", f"# GPU blocks: {blocks}, # CPU blocks: 2048")
        info("", "gpu_executor.py:126", f"Maximum concurrency for {max_len} tokens per request: {conc:.2f}x")
    else:
        if latest:
            if backend == "FLASH_ATTN":
                info(core, "flash_attn.py:776", "Using FlashAttention version 3")
            info(core, "model_runner.py:305", "Model loading took 0.25 GiB and 0.10 seconds")
        for rank in range(tp * pp):
            if args.kv_cache_memory_bytes:  # vLLM sizes the pool from the flag and prints no memory line
                break
            worker = core if tp * pp == 1 else f"(Worker_TP{rank} pid={os.getpid()}) "
            info(worker, "gpu_worker.py:560" if latest else "gpu_worker.py:298", f"Available KV cache memory: {budget / (tp * pp) / GiB:.2f} GiB")
        info(core, "kv_cache_utils.py:2177" if latest else "kv_cache_utils.py:1087", f"GPU KV cache size: {tokens:,} tokens")
        info(core, "kv_cache_utils.py:2178" if latest else "kv_cache_utils.py:1091", f"Maximum concurrency for {max_len:,} tokens per request: {conc:.2f}x")
        if latest:
            info(core, "core.py:340", "init engine (profile, create kv cache, warmup model) took 0.50 s (compilation: 0.00 s)")
        else:
            info(core, "core.py:210", "init engine (profile, create kv cache, warmup model) took 0.50 seconds")
            info(api, "loggers.py:147", f"Engine 000: vllm cache_config_info with initialization after num_gpu_blocks is: {blocks}")
    sched = Scheduler(max_seqs, tokens, float(os.environ.get("FAKE_TOKEN_DELAY_S", "0.004")))
    labels = f'model_name="{served}"' if legacy else f'engine="0",model_name="{served}"'
    usage_names = {"legacy": ["gpu_cache_usage_perc"], "v1": ["gpu_cache_usage_perc", "kv_cache_usage_perc"]}.get(style, ["kv_cache_usage_perc"])

    def metrics_text(s: Scheduler) -> str:
        out = []
        for name, v in [("num_requests_running", s.running), ("num_requests_waiting", s.waiting),
                        *((n, s.usage) for n in usage_names)]:
            out += [f"# TYPE vllm:{name} gauge", f"vllm:{name}{{{labels}}} {float(v)}"]
        for name, v in (("num_preemptions", s.preemptions), ("prompt_tokens", s.prompt_tokens_total),
                        ("generation_tokens", s.generation_tokens_total)):
            out += [f"# TYPE vllm:{name}_total counter", f"vllm:{name}_total{{{labels}}} {float(v)}",
                    f"vllm:{name}_created{{{labels}}} 1.7e9"]
        cfg = (f'block_size="{block}",cache_dtype="{args.kv_cache_dtype}",calculate_kv_scales="{args.calculate_kv_scales}",'
               f'enable_prefix_caching="{args.enable_prefix_caching is not False}",gpu_memory_utilization="{args.gpu_memory_utilization}",'
               f'kv_cache_dtype_skip_layers="{args.kv_cache_dtype_skip_layers}",'
               f'num_cpu_blocks="None",num_gpu_blocks="{blocks}",num_gpu_blocks_override="None"')
        if latest:  # 0.26 adds the pool itself to the info labels
            cfg += (f',engine="0",kv_cache_max_concurrency="{conc}",kv_cache_memory_bytes="{args.kv_cache_memory_bytes}",'
                    f'kv_cache_size_tokens="{tokens}"')
        out += ["# TYPE vllm:cache_config_info gauge", f"vllm:cache_config_info{{{cfg}}} 1.0"]
        return "\n".join(out) + "\n"

    def context_error(limit: int, prompt: int, new: int) -> str:
        if latest:
            return (f"This model's maximum context length is {limit} tokens. However, you requested {new} output tokens and "
                    f"your prompt contains at least {prompt} input tokens, for a total of at least {prompt + new} tokens. "
                    "Please reduce the length of the input prompt or the number of requested output tokens. "
                    f"(parameter=input_tokens, value={prompt})")
        return (f"This model's maximum context length is {limit} tokens. However, you requested {prompt + new} tokens "
                f"({prompt} in the messages, {new} in the completion). Please reduce the length of the messages or completion.")

    def bad_json(e: Exception) -> tuple:
        why = getattr(e, "msg", str(e))  # FastAPI's request validation error, as vLLM 0.26 returns it
        return (f"1 validation error:\n  {{'type': 'json_invalid', 'loc': ('body', 1), 'msg': 'JSON decode error', "
                f"'input': {{}}, 'ctx': {{'error': '{why}'}}}}", "Bad Request", "body.1")

    def error_body(msg: str, typ: str, code: int, param):
        flat = {"message": msg, "type": typ, "param": param, "code": code}
        return {"object": "error", **flat} if legacy else {"error": flat}

    fields = {"legacy": ("reasoning_content",), "v1": ("reasoning_content", "reasoning")}.get(style, ("reasoning",))
    app_style = EngineStyle(
        name="vllm", served_name=served, model_path=path, max_model_len=max_len,
        reasoning_fields=fields if args.reasoning_parser else (), error_body=error_body, metrics_text=metrics_text,
        owned_by="vllm", flush_route=(("POST",), "/reset_prefix_cache"),
        flush_enabled=os.environ.get("VLLM_SERVER_DEV_MODE") == "1", tokenize=True, check_model_name=True,
        bad_json=bad_json if latest else None, context_error=context_error, context_param="input_tokens" if latest else None, flush_json=latest, value_suffix=latest, extra_card={"permission": []})
    if latest:
        info(api, "api_server.py:677", f"Starting vLLM server on http://{args.host}:{args.port}")
    else:
        info(api, "api_server.py:1971", f"Starting vLLM API server 0 on http://{args.host}:{args.port}")
    emit(f"{api}INFO:     Application startup complete.")
    serve(build_app(app_style, sched), args.host, args.port)


if __name__ == "__main__":
    main(sys.argv[1:])
