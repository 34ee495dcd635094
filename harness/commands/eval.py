"""`kvbench eval`: run accuracy / fidelity suites against the embedded engine or an external server.

    kvbench eval --suite gsm8k --limit 50 --data-dir DIR --out runs/gsm8k-bf16
    kvbench eval --suite fidelity --kv-dtype fp8_e4m3 --kv-scales calibrate --limit 16 --data-dir DIR
    kvbench eval --lm-eval hellaswag --limit 100 --endpoint http://127.0.0.1:8000
    kvbench eval --suite ruler --context-lengths 1024,4096 --depths 3 --ruler-tasks niah_single,vt --limit 4
    kvbench eval --suite gpqa_diamond,aime25 --endpoint URL --prompt-style gpt_oss --reasoning-effort high --repeats 8
    kvbench eval --suite gsm8k_chat --endpoint http://node1:8000,http://node2:8000 --concurrency 16   # replicas

``--out DIR`` receives ``items.jsonl`` (one record per item and repeat) and ``summary.json`` (docs/accuracy.md),
both written atomically.  Request flags (--reasoning-effort, --top-p, --top-k, --extra-body, --request-timeout,
--max-retries, --api-key) are those of a sweep's ``request`` and target keys (harness/request_options.py).
``--out`` and ``--data-dir`` are checked before the model loads; a directory that already holds results is
refused unless ``--overwrite`` is given, and a run that fails before producing any record writes nothing
(earlier results stay as they were).  The fidelity reference is the same engine
configuration with bf16 KV, unit scales and torch backends (with ``--endpoint`` too: the reference is the
embedded engine); its top-k figures are cached per (model identity, logits-relevant settings, texts) in
``--fidelity-cache`` (default ``$KVBENCH_CACHE/fidelity``, ``~/.cache/kvbench/fidelity``), capped by
``KVBENCH_FIDELITY_CACHE_MAX_MB`` (suites/fidelity/cache.py; harness/fidelity_key.py says what the key holds).
Several ``--endpoint`` URLs are data-parallel replicas of one server configuration, as an endpoint target's
``base_url`` list (docs/scale-out.md): ``--concurrency`` per replica, records name their ``replica``, failover; a
replica whose requests fail with a connection error ``--replica-max-failures`` times in a row (default 3) leaves
the rotation.
"""

from __future__ import annotations

from typing import Optional

import typer

from kvbench.harness.commands.eval_support import (Borrowed, cache_dir, check_paths, diagnose_spec, endpoint_urls,
                                                   eval_summary, http_options, open_replicas, print_summary,
                                                   request_options, run_suites, suite_names_of, suite_plan,
                                                   write_results)
from kvbench.harness.options import engine_options
from kvbench.suites import RunContext, suite_names

_RULER = "Long context (--suite ruler)"


def _reference_config(engine):
    """The fidelity reference of ``engine``: its KV configuration's reference (bf16, no options) on the torch
    backend."""
    return engine.with_kv(engine.kv.reference(backend="torch"))


def _open_client(engine, endpoint: Optional[str], http: Optional[dict] = None, replicas: Optional[list] = None,
                 max_failures: Optional[int] = None):
    """The embedded engine, or (``--endpoint``) an ``OpenAIClient`` with ``http``'s api_key / timeout /
    max_retries; several ``--endpoint`` URLs (``replicas``): a ``ReplicaClient`` over them (``max_failures``:
    ``--replica-max-failures``)."""
    if replicas and len(replicas) > 1:
        return open_replicas(replicas, engine.model, http or {}, max_failures)
    if endpoint:
        try:
            from kvbench.harness.openai_client import OpenAIClient
        except ImportError as e:
            raise typer.BadParameter(f"--endpoint needs kvbench.harness.openai_client ({e})") from None
        try:
            return OpenAIClient(endpoint, model=engine.model, **(http or {}))
        except ConnectionError as e:
            raise typer.BadParameter(f"--endpoint: no server answers at {endpoint} ({e}); start one (kvbench serve, "
                                     "vllm serve, python -m sglang.launch_server) or check the URL") from None
    from kvbench.harness.engine_client import EngineClient

    return EngineClient(engine)


def _fidelity_context(engine, endpoint, client, fidelity_cache, fidelity_exact, fidelity_top_k, greedy_tokens):
    """Where the fidelity suite finds its reference: the engine's reference configuration (the candidate itself
    when they are the same), sharing the candidate's weights; cached under --fidelity-cache."""
    from kvbench.core import canonical_key
    from kvbench.suites import FidelityContext

    ref_cfg = _reference_config(engine)
    label = f"{client.model_id}:ref-bf16-torch:{canonical_key(ref_cfg.to_dict())}"

    def make_reference():
        if not endpoint and ref_cfg == engine:
            return Borrowed(client)
        from kvbench.harness.engine_client import sharing_client

        return sharing_client(ref_cfg, None if endpoint else client)  # the candidate's weights, not a second copy

    def reference_key() -> dict:  # the cache key's view of the reference: model identity + logits settings
        from kvbench.harness.fidelity_key import embedded_reference_key

        return embedded_reference_key(ref_cfg).to_dict()

    return FidelityContext(label, make_reference, cache_dir(fidelity_cache), fidelity_exact, fidelity_top_k, greedy_tokens,
                           key=reference_key)


def eval_cmd(
    engine,
    suite: Optional[str] = typer.Option(None, "--suite", help=f"Suite(s), comma-separated: {', '.join(suite_names())} (default gsm8k)"),
    limit: Optional[int] = typer.Option(None, "--limit", help="First N items of each suite (fidelity: N texts, default 32; ruler: N items per task, length and depth, default 5)"),
    repeats: int = typer.Option(1, "--repeats", help="K samples per item (avg@K, pass@K)"),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="Local JSONL/CSV/parquet files (else the dataset hub; env KVBENCH_DATA_DIR)"),
    out: Optional[str] = typer.Option(None, "--out", help="Write items.jsonl and summary.json here (a directory; refused when it already holds them, see --overwrite)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the items.jsonl / summary.json that --out already holds"),
    endpoint: Optional[list[str]] = typer.Option(None, "--endpoint", help="External OpenAI-compatible server URL instead of the embedded engine; several (repeat the flag, or a comma list): data-parallel replicas of one server configuration, --concurrency per replica, each record names its replica, a request a replica fails to answer goes to another"),
    replica_max_failures: Optional[int] = typer.Option(None, "--replica-max-failures", help="With several --endpoint URLs: connection failures in a row (after --max-retries) that take a replica out of rotation for the rest of the run (default 3); with none left the run stops"),
    concurrency: int = typer.Option(8, "--concurrency", "--max-concurrency", help="Requests in flight, per replica with several --endpoint URLs (--max-concurrency: the vLLM / SGLang benchmarks' spelling)"),
    lm_eval: Optional[str] = typer.Option(None, "--lm-eval", help="Run an lm-eval task by name (same as --suite lm_eval:TASK)"),
    lm_eval_include: Optional[str] = typer.Option(None, "--lm-eval-include", help="Extra lm-eval task directory"),
    protocol: Optional[str] = typer.Option(None, "--protocol", help="Suite variant, e.g. gsm8k: lm-eval (5-shot), cot (8-shot), chat (0-shot)"),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Override the protocol's generation budget"),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="Override the protocol's temperature"),
    reasoning_effort: Optional[str] = typer.Option(None, "--reasoning-effort", help="low, medium or high: sent with chat requests (embedded engine: a chat-template variable where the template has one)"),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Override the protocol's top-p"),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Override the protocol's top-k (0 = off)"),
    extra_body: Optional[str] = typer.Option(None, "--extra-body", help="JSON object merged into every request body (--endpoint only), e.g. '{\"chat_template_kwargs\": {\"enable_thinking\": true}}'"),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Bearer token for --endpoint"),
    request_timeout: Optional[float] = typer.Option(None, "--request-timeout", help="Seconds to wait for each response with --endpoint (default 600)"),
    max_retries: Optional[int] = typer.Option(None, "--max-retries", help="Retries of a request that got no response (refused, reset) with --endpoint, with backoff (default 3)"),
    sample_seed: int = typer.Option(0, "--sample-seed", help="Base of the per-(item, repeat) sampling seeds"),
    fidelity_exact: bool = typer.Option(False, "--fidelity-exact", help="Fidelity: run the reference live and compute exact full-vocabulary KL"),
    fidelity_cache: Optional[str] = typer.Option(None, "--fidelity-cache", help="Fidelity reference cache directory"),
    fidelity_top_k: int = typer.Option(64, "--fidelity-top-k", help="Fidelity: reference top-k kept per position"),
    greedy_tokens: int = typer.Option(32, "--greedy-tokens", help="Fidelity: greedy continuation window"),
    fidelity_text_tokens: Optional[int] = typer.Option(None, "--fidelity-text-tokens", help="Fidelity: long texts of this many tokens (GSM8K solutions concatenated, or --haystack-file) instead of single solutions; KL by position bucket shows how error grows with context"),
    position_buckets: Optional[int] = typer.Option(None, "--position-buckets", help="Fidelity: first position bucket edge (buckets 0-N, N-2N, 2N-4N, ...; default 512)"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress bar on a terminal"),
    context_lengths: Optional[str] = typer.Option(None, "--context-lengths", help="ruler: prompt lengths in target tokens, e.g. 1024,4096,32k (default 1024,2048,4096)", rich_help_panel=_RULER),
    depths: Optional[str] = typer.Option(None, "--depths", help="ruler: N needle depths spread over 0-100% (N=1: 50%), or percents 10,50,90 (default 5)", rich_help_panel=_RULER),
    ruler_tasks: Optional[str] = typer.Option(None, "--ruler-tasks", help="ruler: tasks, comma-separated: niah_single, niah_multikey, niah_multivalue, niah_multiquery, vt, cwe, fwe (default all)", rich_help_panel=_RULER),
    haystack: Optional[str] = typer.Option(None, "--haystack", help="ruler: built-in haystack: auto (RULER's per task), noise, essay", rich_help_panel=_RULER),
    haystack_file: Optional[str] = typer.Option(None, "--haystack-file", help="ruler: natural-text haystack from this UTF-8 file (never fetched)", rich_help_panel=_RULER),
    prompt_style: Optional[str] = typer.Option(None, "--prompt-style", help="ruler: chat or completion (default chat when the tokenizer has a chat template); gpqa_diamond / aime24 / aime25: kvbench (default), gpt_oss (the gpt-oss evals' prompt and grader), simple_evals (gpqa_diamond)", rich_help_panel=_RULER),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="ruler with --endpoint: tokenizer.json, HF directory, .gguf or hub name (default: the server's /tokenize)", rich_help_panel=_RULER),
    diagnose: bool = typer.Option(False, "--diagnose", help="Also diagnose the KV format per layer and head (embedded engine, quantized KV): OUT/diagnostics/ gets diagnostics.json and its report (kvbench diagnose)"),
    diagnose_kl_limit: Optional[float] = typer.Option(None, "--diagnose-kl-limit", help="With --diagnose: also suggest (and measure) the fewest layers to keep in bf16 so KL <= this"),
) -> None:
    """Run accuracy and fidelity suites; per-item records and a summary (docs/accuracy.md)."""
    import json
    import logging

    from kvbench.suites import SuiteError

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per HTTP request otherwise
    replicas = endpoint_urls(endpoint, replica_max_failures)
    endpoint = replicas[0] if replicas else None
    flags = {"context_lengths": context_lengths, "depths": depths, "tasks": ruler_tasks, "haystack": haystack,
             "haystack_file": haystack_file, "tokenizer": tokenizer, "text_tokens": fidelity_text_tokens,
             "position_buckets": position_buckets}
    try:
        request = request_options(endpoint, {"reasoning_effort": reasoning_effort, "top_p": top_p, "top_k": top_k}, extra_body)
        plan = suite_plan(suite_names_of(suite, lm_eval, protocol), flags, prompt_style, endpoint, request,
                          dict(limit=limit, repeats=repeats, data_dir=data_dir, concurrency=concurrency, seed=sample_seed,
                               max_tokens=max_tokens, temperature=temperature, progress=progress))
        http = http_options(endpoint, api_key, request_timeout, max_retries)
    except SuiteError as e:
        raise typer.BadParameter(str(e)) from None
    out_dir = check_paths(data_dir, out, overwrite)
    diag_spec = diagnose_spec(diagnose, diagnose_kl_limit, endpoint, out_dir, engine)
    client = _open_client(engine, endpoint, http, replicas, replica_max_failures) if http else _open_client(engine, endpoint)
    ctx = RunContext(fidelity=_fidelity_context(engine, endpoint, client, fidelity_cache, fidelity_exact, fidelity_top_k,
                                                greedy_tokens), lm_eval_include=lm_eval_include)
    records, summaries, error, usage_error, info, diag_brief = run_suites(plan, client, ctx, diag_spec, data_dir, out_dir)
    summary = eval_summary(summaries, error, info, None if endpoint else engine.to_dict(), replicas, client, diag_brief)
    out = write_results(out_dir, out, records, summary, error)
    if summaries:
        print_summary(summaries)
    typer.echo(json.dumps({"suites": summaries, "error": error, "out": out}, indent=2, default=str))
    if error:
        from kvbench.harness.errors import UserError

        if usage_error:
            raise UserError(error)
        typer.echo(f"kvbench eval: error: {error}", err=True)  # an engine/server failure: exit 1
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("eval")(engine_options(eval_cmd))
