"""The parts of `kvbench eval` around its command (harness/commands/eval.py): flag checks, the suites' plan, the
run loop, the summary table, the output files, and ``--diagnose``."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import typer

from kvbench.suites import PROMPT_STYLE_SUITES, SUITE_FLAG_POSITIVE, SUITE_FLAG_REQUIRES, SUITE_FLAGS

def cache_dir(opt: Optional[str]) -> Path:
    if opt:
        return Path(opt)
    base = os.environ.get("KVBENCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kvbench")
    return Path(base) / "fidelity"


class Borrowed:
    """The candidate client lent to the fidelity suite as its own reference (closing it is a no-op)."""

    def __init__(self, client):
        self._c = client
        self.model_id = client.model_id

    def __getattr__(self, name):
        return getattr(self._c, name)

    def close(self) -> None:
        pass


RESULT_FILES = ("items.jsonl", "summary.json")
_REQUEST_FLAGS = {"reasoning_effort": "--reasoning-effort", "top_p": "--top-p", "top_k": "--top-k",
                  "extra_body": "--extra-body"}
EVAL_TIMEOUT_S = 600.0  # --request-timeout default (sweep targets default to 3600 s)


def request_options(endpoint: Optional[str], values: dict, extra_body: Optional[str]) -> dict:
    """The request options of the request flags (harness/request_options.py); a bad value raises
    ``SuiteError`` naming its flag."""
    import json

    from kvbench.harness.config_checks import SweepConfigError
    from kvbench.harness.request_options import parse_request
    from kvbench.suites import SuiteError

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


def endpoint_urls(values: Optional[list], max_failures: Optional[int] = None) -> Optional[list[str]]:
    """The ``--endpoint`` URLs (repeated, or comma lists; several must be distinct http(s) URLs); None without.
    ``max_failures`` (``--replica-max-failures``) must be >= 1 and needs several URLs: a usage error otherwise."""
    from kvbench.harness.config_checks import SweepConfigError
    from kvbench.harness.replica_set import urls_of_flag

    urls = None
    if values:
        try:
            urls = urls_of_flag(values, "--endpoint")
        except SweepConfigError as e:
            usage_error(str(e))
    if max_failures is not None and (not urls or len(urls) < 2):
        usage_error("--replica-max-failures applies to several --endpoint URLs (data-parallel replicas)")
    if max_failures is not None and max_failures < 1:
        usage_error(f"--replica-max-failures must be a whole number >= 1, got {max_failures}")
    return urls


def open_replicas(urls: list[str], model: Optional[str], http: dict, max_failures: Optional[int] = None):
    """A ``ReplicaClient`` over the ``--endpoint`` replicas, every one up and serving the same model (else a
    usage error naming the one that is not); ``max_failures``: ``--replica-max-failures`` (None: the default)."""
    from kvbench.harness.openai_client import OpenAIClient
    from kvbench.harness.replica_client import ReplicaClient
    from kvbench.harness.replica_set import check_same_model

    try:
        model_id = check_same_model(urls, model, http.get("api_key"))
    except (ValueError, ConnectionError) as e:
        usage_error(f"--endpoint: {e}")
    clients = [OpenAIClient(url, model=model_id, **http) for url in urls]
    return ReplicaClient(clients) if max_failures is None else ReplicaClient(clients, max_failures=max_failures)


def http_options(endpoint: Optional[str], api_key: Optional[str], timeout: Optional[float], retries: Optional[int]) -> dict:
    from kvbench.harness.request_options import DEFAULT_MAX_RETRIES
    from kvbench.suites import SuiteError

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


def style_extra(names: list[str], style: Optional[str]) -> dict:
    """``--prompt-style`` for gpqa_diamond / aime (kvbench, gpt_oss, simple_evals) as those suites' params."""
    from kvbench.harness.request_options import prompt_styles
    from kvbench.suites import SuiteError

    if style is None:
        return {}
    chosen = [n for n in names if n in PROMPT_STYLE_SUITES]
    if not chosen:
        raise SuiteError(f"--prompt-style {style} applies to --suite {', '.join(PROMPT_STYLE_SUITES)} (and chat/completion to ruler)")
    for n in chosen:
        if style not in prompt_styles(n):
            raise SuiteError(f"--prompt-style {style!r} is not a style of {n}; choose one of: {', '.join(prompt_styles(n))}")
    return {"prompt_style": style}


def usage_error(msg: str) -> None:
    from kvbench.harness.errors import UserError

    raise UserError(msg)


def check_paths(data_dir: Optional[str], out: Optional[str], overwrite: bool) -> Optional[Path]:
    """Fail fast (before the model loads) on a --data-dir or --out that cannot work; returns --out as a Path."""
    from kvbench.core import OutDirError, check_out_dir

    if data_dir is not None:
        d = Path(data_dir)
        if not d.exists():
            usage_error(f"--data-dir {data_dir} does not exist")
        if not d.is_dir():
            usage_error(f"--data-dir {data_dir} is not a directory")
    if not out:
        return None
    try:
        out_dir = check_out_dir(out, "--out")
    except OutDirError as e:
        usage_error(str(e))
    held = [n for n in RESULT_FILES if (out_dir / n).exists()]
    if held and not overwrite:
        usage_error(f"--out {out} already holds results ({', '.join(held)}); pass --overwrite to replace them "
                     "or choose another directory")
    return out_dir


def print_summary(summaries: dict[str, dict]) -> None:
    from kvbench.harness.term import console, table

    t = table("kvbench eval", ("suite", "n", "metrics", "invalid", "truncated", "empty", "errors"))
    skip = {"n", "answered", "errors", "invalid_rate", "truncation_rate", "empty_rate", "error_rate", "source", "subtasks"}
    for name, s in summaries.items():
        metrics = ", ".join(f"{k}={v:.4g}" for k, v in s.items()
                            if k not in skip and isinstance(v, (int, float)) and not isinstance(v, bool))
        rate = lambda k: "-" if s.get(k) is None else f"{s[k]:.1%}"  # noqa: E731
        t.add_row(name, str(s.get("n", "")), metrics, rate("invalid_rate"), rate("truncation_rate"), rate("empty_rate"),
                  errors_text(s))
    console(stderr=True).print(t)
    if any(s.get("errors") for s in summaries.values()):
        console(stderr=True).print("metrics, invalid, truncated and empty are over answered requests; "
                                   "failed requests (errors) are counted apart, not as wrong answers")


def errors_text(s: dict) -> str:
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


def diagnose_spec(diagnose: bool, kl_limit: Optional[float], endpoint: Optional[str], out_dir: Optional[Path], engine):
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


def run_diagnosis(spec, client, data_dir: Optional[str], out_dir: Path) -> dict:
    """Diagnose the eval's engine; OUT/diagnostics/ gets diagnostics.json and report.md / report.html."""
    import sys

    from kvbench.core import atomic_write_json
    from kvbench.harness.cell_diagnostics import brief, run_cell_diagnostics
    from kvbench.reports.diagnostics_report import write_report

    diag = run_cell_diagnostics(spec, client, data_dir, progress=lambda m: print(f"diagnose: {m}", file=sys.stderr, flush=True))
    d = out_dir / "diagnostics"
    d.mkdir(parents=True, exist_ok=True)
    atomic_write_json(d / "diagnostics.json", diag)
    write_report(diag, d)
    return brief(diag)


_GEN_STYLES = ("kvbench", "gpt_oss", "simple_evals")  # gpqa / aime's --prompt-style values (ruler: chat / completion)


@dataclass
class SuitePlan:
    """What `kvbench eval` runs: the concrete suites, their options, and each suite's params from the flags it
    declares (SUITE_FLAGS in suites/registry.py)."""

    names: list
    opts: object  # SuiteOptions
    extras: dict  # suite -> params from its flags
    style_extra: dict

    def options_for(self, name: str):
        if name in self.extras:
            return replace(self.opts, extra=self.extras[name])
        if name in PROMPT_STYLE_SUITES:
            return replace(self.opts, extra=self.style_extra)
        return self.opts


def suite_names_of(suite: Optional[str], lm_eval: Optional[str], protocol: Optional[str]) -> list[str]:
    from kvbench.suites import resolve

    names = [s.strip() for s in (suite or "").split(",") if s.strip()]
    if lm_eval:
        names.append(f"lm_eval:{lm_eval}")
    return [resolve(n, protocol) for n in (names or ["gsm8k"])]


def _flag_owners(param: str, flags: dict, names: list[str]) -> list[str]:
    """The chosen suites that take ``param`` from its flag (a flag that needs another is taken only with it)."""
    return [s for s, table in SUITE_FLAGS.items() if param in table and s in names
            and flags.get(SUITE_FLAG_REQUIRES.get((s, param), param)) is not None]


def _not_applicable(param: str) -> str:
    """``--haystack-file applies to --suite ruler only (and to fidelity with --fidelity-text-tokens)``."""
    owners = [s for s, table in SUITE_FLAGS.items() if param in table]
    plain = [s for s in owners if (s, param) not in SUITE_FLAG_REQUIRES]
    flag = SUITE_FLAGS[owners[0]][param]
    text = f"{flag} applies to --suite {' or '.join(plain or owners)} only"
    for s in owners:
        if (s, param) in SUITE_FLAG_REQUIRES:
            text += f" (and to {s} with {SUITE_FLAGS[s][SUITE_FLAG_REQUIRES[(s, param)]]})"
    return text


def suite_plan(names: list[str], flags: dict, prompt_style: Optional[str], endpoint: Optional[str],
               request: dict, opts_kw: dict):
    """Check the suite flags against the suites chosen (``flags``: suite param -> value, None when not given;
    which suite takes which flag is the registry's SUITE_FLAGS) and build the plan; ``SuiteError`` says which
    flag does not apply."""
    from kvbench.suites import SuiteError, SuiteOptions, check_params

    gen_style = prompt_style if prompt_style in _GEN_STYLES else None
    flags = {**flags, "prompt_style": None if gen_style else prompt_style}
    extras: dict[str, dict] = {s: {} for s in SUITE_FLAGS if s in names}
    for param in dict.fromkeys(p for table in SUITE_FLAGS.values() for p in table):
        value = flags.get(param)
        if value is None:
            continue
        owners = _flag_owners(param, flags, names)
        if not owners:
            raise SuiteError(_not_applicable(param))
        for s in owners:
            if (s, param) in SUITE_FLAG_POSITIVE and value <= 0:
                raise SuiteError(f"{SUITE_FLAGS[s][param]} must be positive, got {value}")
            extras[s][param] = value
    if flags.get("tokenizer") is not None and not endpoint:
        raise SuiteError("--tokenizer applies to --endpoint only (the embedded engine uses its own tokenizer)")
    for s, params in extras.items():
        check_params(s, params)
    opts = SuiteOptions(request=request, **opts_kw)
    return SuitePlan(names, opts, extras, style_extra(names, gen_style))


def run_suites(plan: SuitePlan, client, ctx, diag_spec, data_dir: Optional[str], out_dir: Optional[Path]):
    """Run the plan's suites on ``client``: ``(records, summaries, error, usage_error, info, diagnosis brief)``;
    an error keeps what finished."""
    import logging

    from kvbench.suites import SuiteError, SuiteInputError
    from kvbench.suites import DataError
    from kvbench.suites import run_suite

    records: list[dict] = []
    summaries: dict[str, dict] = {}
    error, usage, info, diag_brief = None, False, {}, None
    try:
        info = client.info()
        for name in plan.names:
            res = run_suite(name, client, plan.options_for(name), ctx)
            records += res.records
            for k, s in res.summaries().items():
                summaries[k] = {**s, "source": res.source}
        if diag_spec is not None:
            diag_brief = run_diagnosis(diag_spec, client, data_dir, out_dir)
    except (SuiteError, DataError) as e:
        error, usage = str(e), isinstance(e, SuiteInputError)  # bad input found once the target is known: exit 2
    except Exception as e:  # an engine or server failure: keep what finished, report, exit 1
        logging.getLogger("kvbench.eval").exception("suite failed")
        error = f"{type(e).__name__}: {e}"
    finally:
        client.close()
    return records, summaries, error, usage, info, diag_brief


def eval_summary(summaries: dict, error: Optional[str], info: dict, engine: Optional[dict], replicas: Optional[list],
                 client, diag_brief: Optional[dict]) -> dict:
    """``summary.json`` of `kvbench eval`: the suites, the target, the engine (None with --endpoint), the
    endpoint (a list for several replicas, with ``replica_health``) and the diagnosis brief."""
    summary = {"suites": summaries, "load": None, "capacity": info.get("capacity"), "error": error, "target": info,
               "engine": engine, "endpoint": (replicas if len(replicas) > 1 else replicas[0]) if replicas else None}
    if callable(getattr(client, "health", None)):  # several replicas: which stayed in rotation, failovers
        summary["replica_health"] = client.health()
    if diag_brief is not None:
        summary["diagnostics"] = diag_brief
    return summary


def write_results(out_dir: Optional[Path], out: Optional[str], records: list, summary: dict, error: Optional[str]):
    """items.jsonl and summary.json into --out (atomically); nothing when no record finished and there was an
    error (whatever --out held stays).  Returns --out as reported, None when nothing was written."""
    from kvbench.core import atomic_write_json, atomic_write_jsonl

    if out_dir is None:
        return out
    if records or not error:
        atomic_write_jsonl(out_dir / "items.jsonl", records)
        atomic_write_json(out_dir / "summary.json", summary)
        return out
    typer.echo(f"no records; nothing written to {out}", err=True)
    return None
