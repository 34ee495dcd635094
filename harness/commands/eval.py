"""`kvbench eval`: run accuracy / fidelity suites against the embedded engine or an external server.

    kvbench eval --suite gsm8k --limit 50 --data-dir DIR --out runs/gsm8k-bf16
    kvbench eval --suite fidelity --kv-dtype fp8_e4m3 --kv-scales calibrate --limit 16 --data-dir DIR
    kvbench eval --lm-eval hellaswag --limit 100 --endpoint http://127.0.0.1:8000
    kvbench eval --suite ruler --context-lengths 1024,4096 --depths 3 --ruler-tasks niah_single,vt --limit 4
    kvbench eval --suite gpqa_diamond,aime25 --endpoint URL --prompt-style gpt_oss --reasoning-effort high --repeats 8

``--out DIR`` receives ``items.jsonl`` (one record per item and repeat) and ``summary.json`` (docs/accuracy.md),
both written atomically.  Request flags (--reasoning-effort, --top-p, --top-k, --extra-body, --request-timeout,
--max-retries, --api-key) are those of a sweep's ``request`` and target keys (harness/request_options.py).
``--out`` and ``--data-dir`` are checked before the model loads; a directory that already holds results is
refused unless ``--overwrite`` is given, and a run that fails before producing any record writes nothing
(earlier results stay as they were).  The fidelity reference is the same engine
configuration with bf16 KV, unit scales and torch backends (with ``--endpoint`` too: the reference is the
embedded engine); its top-k figures are cached per (model identity, logits-relevant settings, texts) in
``--fidelity-cache`` (default ``$KVBENCH_CACHE/fidelity``, ``~/.cache/kvbench/fidelity``), capped by
``KVBENCH_FIDELITY_CACHE_MAX_MB`` (suites/fidelity_cache.py; harness/fidelity_key.py says what the key holds).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from kvbench.harness.options import engine_options
from kvbench.suites.registry import PROMPT_STYLE_SUITES, suite_names


def _cache_dir(opt: Optional[str]) -> Path:
    if opt:
        return Path(opt)
    base = os.environ.get("KVBENCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kvbench")
    return Path(base) / "fidelity"


def _reference_config(engine):
    from dataclasses import replace

    return replace(engine, kv_dtype="bf16", kv_scales="unit", kv_scales_per_head=False, kv_dtype_skip_layers=None,
                   kv_layer_dtypes=None, prefill_backend="torch", decode_backend="torch", quantize_query=False)


class _Borrowed:
    """The candidate client lent to the fidelity suite as its own reference (closing it is a no-op)."""

    def __init__(self, client):
        self._c = client
        self.model_id = client.model_id

    def __getattr__(self, name):
        return getattr(self._c, name)

    def close(self) -> None:
        pass


def _open_client(engine, endpoint: Optional[str], http: Optional[dict] = None):
    """The embedded engine, or (``--endpoint``) an ``OpenAIClient`` with ``http``'s api_key / timeout /
    max_retries."""
    if endpoint:
        try:
            from kvbench.harness.openai_client import OpenAIClient
        except ImportError as e:
            raise typer.BadParameter(f"--endpoint needs kvbench.harness.openai_client ({e})") from None
        return OpenAIClient(endpoint, model=engine.model, **(http or {}))
    from kvbench.harness.engine_client import EngineClient

    return EngineClient(engine)


RESULT_FILES = ("items.jsonl", "summary.json")
_REQUEST_FLAGS = {"reasoning_effort": "--reasoning-effort", "top_p": "--top-p", "top_k": "--top-k",
                  "extra_body": "--extra-body"}
EVAL_TIMEOUT_S = 600.0  # --request-timeout default (sweep targets default to 3600 s)


def _request_options(endpoint: Optional[str], values: dict, extra_body: Optional[str]) -> dict:
    """The request options of the request flags (harness/request_options.py); a bad value raises
    ``SuiteError`` naming its flag."""
    import json

    from kvbench.harness.config_checks import SweepConfigError
    from kvbench.harness.request_options import parse_request
    from kvbench.suites.base import SuiteError

    raw = {k: v for k, v in values.items() if v is not None}
    if extra_body is not None:
        if not endpoint:
            raise SuiteError("--extra-body applies to --endpoint only (the embedded engine has no HTTP request body)")
        try:
            raw["extra_body"] = json.loads(extra_body)
        except ValueError as e:
            raise SuiteError(f"--extra-body must be a JSON object: {e}") from None
    try:
        return parse_request(raw, "request")
    except SweepConfigError as e:
        key, _, msg = str(e)[len("request."):].partition(": ")
        flag = _REQUEST_FLAGS.get(key.split(".")[0], key)
        raise SuiteError(f"{flag}{key[len(key.split('.')[0]):]}: {msg}") from None


def _http_options(endpoint: Optional[str], api_key: Optional[str], timeout: Optional[float], retries: Optional[int]) -> dict:
    from kvbench.harness.request_options import DEFAULT_MAX_RETRIES
    from kvbench.suites.base import SuiteError

    given = {"--api-key": api_key, "--request-timeout": timeout, "--max-retries": retries}
    if not endpoint:
        flag = next((f for f, v in given.items() if v is not None), None)
        if flag:
            raise SuiteError(f"{flag} applies to --endpoint only")
        return {}
    if timeout is not None and timeout <= 0:
        raise SuiteError(f"--request-timeout must be positive, got {timeout}")
    if retries is not None and retries < 0:
        raise SuiteError(f"--max-retries must be >= 0, got {retries}")
    return {"api_key": api_key, "timeout": EVAL_TIMEOUT_S if timeout is None else timeout,
            "max_retries": DEFAULT_MAX_RETRIES if retries is None else retries}


def _style_extra(names: list[str], style: Optional[str]) -> dict:
    """``--prompt-style`` for gpqa_diamond / aime (kvbench, gpt_oss, simple_evals) as those suites' params."""
    from kvbench.harness.request_options import prompt_styles
    from kvbench.suites.base import SuiteError

    if style is None:
        return {}
    chosen = [n for n in names if n in PROMPT_STYLE_SUITES]
    if not chosen:
        raise SuiteError(f"--prompt-style {style} applies to --suite {', '.join(PROMPT_STYLE_SUITES)} (and chat/completion to ruler)")
    for n in chosen:
        if style not in prompt_styles(n):
            raise SuiteError(f"--prompt-style {style!r} is not a style of {n}; choose one of: {', '.join(prompt_styles(n))}")
    return {"prompt_style": style}
_RULER = "Long context (--suite ruler)"


def _usage_error(msg: str) -> None:
    from kvbench.harness.errors import UserError

    raise UserError(msg)


def _check_paths(data_dir: Optional[str], out: Optional[str], overwrite: bool) -> Optional[Path]:
    """Fail fast (before the model loads) on a --data-dir or --out that cannot work; returns --out as a Path."""
    from kvbench.core.store import OutDirError, check_out_dir

    if data_dir is not None:
        d = Path(data_dir)
        if not d.exists():
            _usage_error(f"--data-dir {data_dir} does not exist")
        if not d.is_dir():
            _usage_error(f"--data-dir {data_dir} is not a directory")
    if not out:
        return None
    try:
        out_dir = check_out_dir(out, "--out")
    except OutDirError as e:
        _usage_error(str(e))
    held = [n for n in RESULT_FILES if (out_dir / n).exists()]
    if held and not overwrite:
        _usage_error(f"--out {out} already holds results ({', '.join(held)}); pass --overwrite to replace them "
                     "or choose another directory")
    return out_dir


def _print_summary(summaries: dict[str, dict]) -> None:
    from kvbench.harness.term import console, table

    t = table("kvbench eval", ("suite", "n", "metrics", "invalid", "truncated", "empty", "errors"))
    skip = {"n", "answered", "errors", "invalid_rate", "truncation_rate", "empty_rate", "error_rate", "source", "subtasks"}
    for name, s in summaries.items():
        metrics = ", ".join(f"{k}={v:.4g}" for k, v in s.items()
                            if k not in skip and isinstance(v, (int, float)) and not isinstance(v, bool))
        rate = lambda k: "-" if s.get(k) is None else f"{s[k]:.1%}"  # noqa: E731
        t.add_row(name, str(s.get("n", "")), metrics, rate("invalid_rate"), rate("truncation_rate"), rate("empty_rate"),
                  _errors_text(s))
    console(stderr=True).print(t)
    if any(s.get("errors") for s in summaries.values()):
        console(stderr=True).print("metrics, invalid, truncated and empty are over answered requests; "
                                   "failed requests (errors) are counted apart, not as wrong answers")


def _errors_text(s: dict) -> str:
    """Failed requests of one suite: "3 (2.5%: timeout 2, http 1)", "0", or "-" (older summaries)."""
    if "errors" not in s:
        return "-"
    n = int(s.get("errors") or 0)
    if not n:
        return "0"
    kinds = ", ".join(f"{k} {v}" for k, v in sorted((s.get("error_kinds") or {}).items()))
    rate = s.get("error_rate")
    inner = ": ".join(p for p in (f"{rate:.1%}" if rate is not None else "", kinds) if p)
    return f"{n} ({inner})" if inner else str(n)


def _diagnose_spec(diagnose: bool, kl_limit: Optional[float], endpoint: Optional[str], out_dir: Optional[Path], engine):
    """The diagnostics of ``--diagnose`` (None without it); usage errors for what it cannot do."""
    from kvbench.harness.cell_diagnostics import DiagnosticsSpec
    from kvbench.harness.diagnose import check_diagnosable
    from kvbench.harness.errors import UserError

    if not diagnose:
        if kl_limit is not None:
            raise UserError("--diagnose-kl-limit applies with --diagnose only")
        return None
    if endpoint:
        raise UserError("--diagnose needs the embedded engine (a server's cache has no per-layer view); drop --endpoint")
    if out_dir is None:
        raise UserError("--diagnose writes OUT/diagnostics/: give --out")
    try:
        check_diagnosable(engine)
    except ValueError as e:
        raise UserError(f"--diagnose: {e}") from None
    if kl_limit is not None and not kl_limit >= 0:
        raise UserError(f"--diagnose-kl-limit must be >= 0, got {kl_limit}")
    return DiagnosticsSpec(kl_limit=kl_limit)


def _run_diagnosis(spec, client, data_dir: Optional[str], out_dir: Path) -> dict:
    """Diagnose the eval's engine; OUT/diagnostics/ gets diagnostics.json and report.md / report.html."""
    import sys

    from kvbench.core.io import atomic_write_json
    from kvbench.harness.cell_diagnostics import brief, run_cell_diagnostics
    from kvbench.reports.diagnostics_report import write_report

    diag = run_cell_diagnostics(spec, client, data_dir, progress=lambda m: print(f"diagnose: {m}", file=sys.stderr, flush=True))
    d = out_dir / "diagnostics"
    d.mkdir(parents=True, exist_ok=True)
    atomic_write_json(d / "diagnostics.json", diag)
    write_report(diag, d)
    return brief(diag)


def register(app: typer.Typer) -> None:
    @app.command("eval")
    @engine_options
    def eval_cmd(
        engine,
        suite: Optional[str] = typer.Option(None, "--suite", help=f"Suite(s), comma-separated: {', '.join(suite_names())} (default gsm8k)"),
        limit: Optional[int] = typer.Option(None, "--limit", help="First N items of each suite (fidelity: N texts, default 32; ruler: N items per task, length and depth, default 5)"),
        repeats: int = typer.Option(1, "--repeats", help="K samples per item (avg@K, pass@K)"),
        data_dir: Optional[str] = typer.Option(None, "--data-dir", help="Local JSONL/CSV/parquet files (else the dataset hub; env KVBENCH_DATA_DIR)"),
        out: Optional[str] = typer.Option(None, "--out", help="Write items.jsonl and summary.json here (a directory; refused when it already holds them, see --overwrite)"),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace the items.jsonl / summary.json that --out already holds"),
        endpoint: Optional[str] = typer.Option(None, "--endpoint", help="External OpenAI-compatible server URL instead of the embedded engine"),
        concurrency: int = typer.Option(8, "--concurrency", "--max-concurrency", help="Requests in flight (--max-concurrency: the vLLM / SGLang benchmarks' spelling)"),
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
        from dataclasses import replace

        from kvbench.core.io import atomic_write_json, atomic_write_jsonl, canonical_key
        from kvbench.suites.base import SuiteError, SuiteInputError, SuiteOptions
        from kvbench.suites.data import DataError
        from kvbench.suites.registry import FidelityContext, RunContext, resolve, run_suite

        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per HTTP request otherwise
        names = [s.strip() for s in (suite or "").split(",") if s.strip()]
        if lm_eval:
            names.append(f"lm_eval:{lm_eval}")
        names = names or ["gsm8k"]
        gen_style = prompt_style if prompt_style in ("kvbench", "gpt_oss", "simple_evals") else None  # gpqa / aime's
        ruler_flags = {"context_lengths": context_lengths, "depths": depths, "tasks": ruler_tasks, "haystack": haystack,
                       "haystack_file": haystack_file, "prompt_style": None if gen_style else prompt_style, "tokenizer": tokenizer}
        extra = {k: v for k, v in ruler_flags.items() if v is not None}
        fidelity_flags = {"text_tokens": fidelity_text_tokens, "position_buckets": position_buckets}
        fid_extra: dict = {"haystack_file": haystack_file} if haystack_file is not None and fidelity_text_tokens is not None else {}
        try:
            names = [resolve(n, protocol) for n in names]
            long_fidelity = "fidelity" in names and fidelity_text_tokens is not None
            ruler_only = {k: v for k, v in extra.items() if not (long_fidelity and k == "haystack_file")}
            if ruler_only and "ruler" not in names:
                flag = "--" + ("ruler-tasks" if next(iter(ruler_only)) == "tasks" else next(iter(ruler_only)).replace("_", "-"))
                raise SuiteError(f"{flag} applies to --suite ruler only" + (" (and to fidelity with --fidelity-text-tokens)" if flag == "--haystack-file" else ""))
            for k, v in fidelity_flags.items():
                if v is None:
                    continue
                if "fidelity" not in names:
                    raise SuiteError(f"--{'fidelity-text-tokens' if k == 'text_tokens' else 'position-buckets'} applies to --suite fidelity only")
                if v <= 0:
                    raise SuiteError(f"--{'fidelity-text-tokens' if k == 'text_tokens' else 'position-buckets'} must be positive, got {v}")
                fid_extra[k] = v
            if tokenizer is not None and not endpoint:
                raise SuiteError("--tokenizer applies to --endpoint only (the embedded engine uses its own tokenizer)")
            if "ruler" in names:
                from kvbench.suites.ruler_params import parse_params

                parse_params(extra)
            style_extra = _style_extra(names, gen_style)
            request = _request_options(endpoint, {"reasoning_effort": reasoning_effort, "top_p": top_p, "top_k": top_k},
                                       extra_body)
            http = _http_options(endpoint, api_key, request_timeout, max_retries)
            opts = SuiteOptions(limit=limit, repeats=repeats, data_dir=data_dir, concurrency=concurrency, seed=sample_seed, request=request,
                                max_tokens=max_tokens, temperature=temperature, progress=progress, extra=extra)
        except SuiteError as e:
            raise typer.BadParameter(str(e)) from None
        out_dir = _check_paths(data_dir, out, overwrite)
        diag_spec = _diagnose_spec(diagnose, diagnose_kl_limit, endpoint, out_dir, engine)

        client = _open_client(engine, endpoint, http) if http else _open_client(engine, endpoint)
        ref_cfg = _reference_config(engine)
        label = f"{client.model_id}:ref-bf16-torch:{canonical_key(ref_cfg.to_dict())}"

        def make_reference():
            if not endpoint and ref_cfg == engine:
                return _Borrowed(client)
            from kvbench.harness.engine_client import sharing_client

            return sharing_client(ref_cfg, None if endpoint else client)  # the candidate's weights, not a second copy

        def reference_key() -> dict:  # the cache key's view of the reference: model identity + logits settings
            from kvbench.harness.fidelity_key import embedded_reference_key

            return embedded_reference_key(ref_cfg).to_dict()

        ctx = RunContext(
            fidelity=FidelityContext(label, make_reference, _cache_dir(fidelity_cache), fidelity_exact, fidelity_top_k, greedy_tokens,
                                     key=reference_key),
            lm_eval_include=lm_eval_include,
        )
        records: list[dict] = []
        diag_brief = None
        summaries: dict[str, dict] = {}
        error: Optional[str] = None
        usage_error = False  # bad input found once the target is known (ruler lengths): exit 2, not 1
        info: dict = {}
        try:
            info = client.info()
            for name in names:
                suite_opts = replace(opts, extra=fid_extra) if name == "fidelity" else opts
                if name in PROMPT_STYLE_SUITES:
                    suite_opts = replace(opts, extra=style_extra)
                res = run_suite(name, client, suite_opts, ctx)
                records += res.records
                for k, s in res.summaries().items():
                    summaries[k] = {**s, "source": res.source}
            if diag_spec is not None:
                diag_brief = _run_diagnosis(diag_spec, client, data_dir, out_dir)
        except (SuiteError, DataError) as e:
            error = str(e)
            usage_error = isinstance(e, SuiteInputError)
        except Exception as e:  # an engine or server failure: keep what finished, report, exit 1
            logging.getLogger("kvbench.eval").exception("suite failed")
            error = f"{type(e).__name__}: {e}"
        finally:
            client.close()
        summary = {"suites": summaries, "load": None, "capacity": info.get("capacity"), "error": error,
                   "target": info, "engine": None if endpoint else engine.to_dict(), "endpoint": endpoint}
        if diag_brief is not None:
            summary["diagnostics"] = diag_brief
        if out_dir is not None:
            if records or not error:
                atomic_write_jsonl(out_dir / "items.jsonl", records)
                atomic_write_json(out_dir / "summary.json", summary)
            else:  # nothing finished: leave whatever --out held as it was
                typer.echo(f"no records; nothing written to {out}", err=True)
                out = None
        if summaries:
            _print_summary(summaries)
        typer.echo(json.dumps({"suites": summaries, "error": error, "out": out}, indent=2, default=str))
        if error:
            from kvbench.harness.errors import UserError

            if usage_error:
                raise UserError(error)
            typer.echo(f"kvbench eval: error: {error}", err=True)  # an engine/server failure: exit 1
            raise typer.Exit(1)
