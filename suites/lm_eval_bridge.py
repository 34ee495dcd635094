"""Run any lm-eval task against a ``Client`` and store lm-eval's per-sample logs as item records.

``ClientLM`` is an lm-eval model class: ``generate_until`` → ``Client.generate`` (completion API, the
task's ``until`` as stop strings, ``max_gen_toks``, greedy unless the task samples), ``loglikelihood`` →
teacher-forced ``Client.score`` (sum of continuation log-probs, all-greedy flag),
``loglikelihood_rolling`` → ``score`` of the whole text after an empty context (no windowing: a text
longer than the context is an error).  Requests run concurrently on a thread pool of ``concurrency``; over
data-parallel replicas (harness/replica_client.py) ``concurrency`` documents per replica, each document's
requests on one replica, which its record names (``replica``).

Records: one per document; ``scores`` holds every per-sample metric as ``"<metric>,<filter>"`` (lm-eval's
own naming); ``correct`` is the first metric of the first filter when it is 0/1, else null.  A document
whose request failed (raised, or finish_reason ``error``) is an error record as in ``suites.runner``:
``error`` / ``error_kind`` set, ``correct`` / ``invalid`` null, no scores; lm-eval sees an empty generation
(or a log-likelihood of -inf) for it, and its aggregates are then not copied into the summary.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from kvbench.core import REPLICA_FIELD, Client, GenRequest, SamplingParams, ScoreRequest, TargetGone, classify_error
from kvbench.core import effective_options
from kvbench.core import prompt_hash
from kvbench.suites.base import (SuiteError, SuiteOptions, SuiteResult, pinned, replica_width, served_by,
                                 summarize_records)
from kvbench.suites.extract import INVALID

log = logging.getLogger(__name__)


def _make_lm_class():
    from lm_eval.api.model import LM

    class ClientLM(LM):
        def __init__(self, client: Client, concurrency: int = 8, max_gen_toks: int = 256):
            super().__init__()
            self.client, self.concurrency, self.max_gen_toks = client, concurrency, max_gen_toks
            self.meta: dict[tuple[str, Any], list[dict]] = defaultdict(list)
            self._lock = threading.Lock()

        def _note(self, req, **m) -> None:
            if replica_width(self.client) > 1:  # which replica served (or last failed) this request
                m[REPLICA_FIELD] = served_by(self.client)
            with self._lock:
                self.meta[(req.task_name, req.doc_id)].append(m)

        def _failed(self, req, error: str, kind: str, latency_s: float = 0.0, retries: int = 0) -> None:
            self._note(req, finish_reason="error", prompt_tokens=0, output_tokens=0, latency_s=latency_s,
                       error=error, error_kind=kind, retries=retries)

        def _map(self, fn, requests):
            if not requests:
                return []
            width = replica_width(self.client)
            if width == 1:
                with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(requests)))) as pool:
                    return list(pool.map(fn, requests))
            # data-parallel replicas: a document's requests go to one replica, one after another (``pinned``),
            # with ``concurrency`` documents in flight per replica
            docs: dict[tuple, list[int]] = {}
            for i, req in enumerate(requests):
                docs.setdefault((req.task_name, req.doc_id), []).append(i)
            out: list = [None] * len(requests)

            def doc(indices: list[int]) -> None:
                with pinned(self.client):
                    for i in indices:
                        out[i] = fn(requests[i])

            with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency * width, len(docs)))) as pool:
                list(pool.map(doc, docs.values()))
            return out

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            return self._map(lambda req: _generate_one(self, req), requests)

        def _score(self, req, context: str, continuation: str):
            return _score_one(self, req, context, continuation)

        def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            def one(req):
                res = self._score(req, *req.args)
                return (res.total_logprob, res.is_greedy) if res is not None else (_FAILED_LL, False)

            return self._map(one, requests)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            def one(req):
                res = self._score(req, "", req.args[0])
                return res.total_logprob if res is not None else _FAILED_LL

            return self._map(one, requests)

    return ClientLM


def _gen_request(req, max_gen_toks: int) -> GenRequest:
    """An lm-eval ``generate_until`` request as a completion request: the task's ``until`` as stop strings,
    ``max_gen_toks``, greedy unless the task samples with a positive temperature."""
    context, kw = req.args
    kw = dict(kw or {})
    until = kw.pop("until", None) or []
    if isinstance(until, str):
        until = [until]
    sample = bool(kw.get("do_sample", False)) and float(kw.get("temperature", 1.0)) > 0
    params = SamplingParams(
        max_tokens=int(kw.get("max_gen_toks", max_gen_toks)),
        temperature=float(kw.get("temperature", 1.0)) if sample else 0.0,
        top_p=float(kw.get("top_p", 1.0)) if sample else 1.0,
        stop=tuple(until),
    )
    return GenRequest(prompt=context, params=params)


def _generate_one(lm, req) -> str:
    """One generation of ``ClientLM.generate_until``: its text, or "" for a failed request (noted as an error)."""
    gen = _gen_request(req, lm.max_gen_toks)
    try:
        res = lm.client.generate(gen)
    except TargetGone:  # no replica left: the suite stops
        raise
    except Exception as e:  # a failed request: recorded as an error, no answer
        lm._failed(req, f"{type(e).__name__}: {e}", classify_error(e), retries=getattr(e, "retries", 0))
        return ""
    if res.finish_reason == "error":
        lm._failed(req, res.error or "request failed", res.error_kind or "other", res.latency_s, res.retries)
        return ""
    lm._note(req, finish_reason=res.finish_reason, prompt_tokens=res.prompt_tokens,
             output_tokens=res.output_tokens, latency_s=res.latency_s, retries=res.retries,
             reasoning=res.reasoning, request_options=effective_options(gen))
    return res.text


def _score_one(lm, req, context: str, continuation: str):
    """One teacher-forced scoring of ``ClientLM``: the score, or None for a failed request (noted as an error)."""
    import time

    t0 = time.perf_counter()
    try:
        res = lm.client.score(ScoreRequest(context=context, continuation=continuation))
    except (NotImplementedError, TargetGone):
        raise  # the target cannot score at all (or no replica is left): not one failed request
    except Exception as e:  # a failed request: the document becomes an error record
        lm._failed(req, f"{type(e).__name__}: {e}", classify_error(e), time.perf_counter() - t0)
        return None
    lm._note(req, finish_reason="score", prompt_tokens=len(res.token_ids), output_tokens=0,
             latency_s=time.perf_counter() - t0)
    return res


_FAILED_LL = float("-inf")  # what lm-eval sees for a failed scoring request (its record is an error record)


def _scalar(v: Any) -> Optional[float]:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    return None


def _extracted(entry: dict) -> Optional[str]:
    fr = entry.get("filtered_resps") or []
    if not fr:
        return None
    first = fr[0]
    if isinstance(first, str):
        return None if first == INVALID else first
    if isinstance(first, (list, tuple)) and first and isinstance(first[0], (int, float)):
        # loglikelihood tasks: one (logprob, greedy) per choice -> index of the most likely choice
        lls = [f[0] if isinstance(f, (list, tuple)) else f for f in fr]
        return str(max(range(len(lls)), key=lambda i: lls[i]))
    return json.dumps(first, default=str)


def samples_to_records(task: str, samples: list[dict], meta: dict, protocol: str) -> list[dict]:
    by_doc: dict[Any, list[dict]] = {}
    for s in samples:
        by_doc.setdefault(s["doc_id"], []).append(s)
    records = []
    for doc_id in sorted(by_doc, key=lambda d: (str(type(d)), d)):
        entries = by_doc[doc_id]
        first = entries[0]
        scores: dict[str, float] = {}
        for e in entries:
            for m in e.get("metrics", []):
                v = _scalar(e.get(m))
                if v is not None:
                    scores[f"{m},{e.get('filter', 'none')}"] = v
        primary_metric = (first.get("metrics") or [None])[0]
        pv = _scalar(first.get(primary_metric)) if primary_metric else None
        correct = bool(pv) if pv in (0.0, 1.0) else None
        extracted = _extracted(first)
        resps = first.get("resps") or []
        raw = resps[0][0] if resps and resps[0] and isinstance(resps[0][0], str) else json.dumps(resps, default=str)
        ms = meta.get((task, doc_id), [])
        failed = [m for m in ms if m.get("error")]
        finish = "error" if failed else next((m["finish_reason"] for m in reversed(ms) if m["finish_reason"] != "score"), "score" if ms else "stop")
        context = first["arguments"][0][0] if first.get("arguments") else ""
        records.append({
            "suite": f"lm_eval:{task}",
            "item_id": str(doc_id),
            "repeat": 0,
            "seed": None,
            "prompt_hash": prompt_hash(str(context)),
            "raw_output": raw,
            "extracted": None if failed else extracted,
            "target": str(first.get("target")),
            "correct": None if failed else correct,
            "invalid": None if failed else isinstance((first.get("filtered_resps") or [None])[0], str) and extracted is None,
            "finish_reason": finish,
            "prompt_tokens": int(sum(m["prompt_tokens"] for m in ms)),
            "output_tokens": int(sum(m["output_tokens"] for m in ms)),
            "latency_s": float(sum(m["latency_s"] for m in ms)),
            "scores": {} if failed else scores,
            "protocol": protocol,
            "error": failed[0]["error"] if failed else None,
            "error_kind": failed[0].get("error_kind") or "other" if failed else None,
            "request_options": next((m["request_options"] for m in ms if m.get("request_options")), None),
            "reasoning": "\n".join(m["reasoning"] for m in ms if m.get("reasoning")) or None,
            "retries": int(sum(m.get("retries") or 0 for m in ms)),
        })
        replica = next((m[REPLICA_FIELD] for m in reversed(ms) if m.get(REPLICA_FIELD)), None)
        if replica is not None:  # data-parallel replicas: the one that served the document's last request
            records[-1][REPLICA_FIELD] = replica
    return records


def run_lm_eval(task: str, client: Client, opts: SuiteOptions, include_path: Optional[str] = None) -> SuiteResult:
    if opts.repeats != 1:
        raise SuiteError("lm_eval tasks take their repeats from the task YAML; use --repeats 1")
    try:
        import lm_eval
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise SuiteError(f"--lm-eval needs lm-eval installed (pip install 'kvbench[eval]'): {e}") from None
    lm = _make_lm_class()(client, concurrency=opts.concurrency)
    tm = None
    if include_path:  # indexing lm-eval's thousands of built-in tasks is slow: skip it when not needed
        tm = TaskManager(include_path=include_path, include_defaults=False)
        if task not in tm.all_tasks:
            tm = None
    tm = tm or TaskManager(include_path=include_path)
    out = simple_evaluate(
        model=lm, tasks=[task], limit=opts.limit, log_samples=True, task_manager=tm, bootstrap_iters=0,
        random_seed=opts.seed, fewshot_random_seed=1234,
    )
    if out is None or not out.get("samples"):
        raise SuiteError(f"lm-eval returned no samples for task {task!r}")
    version = getattr(lm_eval, "__version__", "?")
    records: list[dict] = []
    summary: dict = {}
    for sub, samples in out["samples"].items():
        proto = f"lm-eval-{version}:{sub}:v{out.get('versions', {}).get(sub, '?')}:{out.get('n-shot', {}).get(sub, '?')}shot:fewshot-seed1234"
        recs = samples_to_records(sub, samples, lm.meta, proto)
        records += recs
        s = summarize_records(recs)
        # lm-eval's own aggregates score a failed request as an answer: use them only when none failed
        for k, v in (out.get("results", {}).get(sub) or {}).items() if not s.get("errors") else ():
            if _scalar(v) is not None and "," in k and "_stderr" not in k:  # "<metric>,<filter>" entries
                s[k] = float(v)
        summary[f"lm_eval:{sub}"] = s
    failed = [r for r in records if r.get("error")]
    if failed and len(failed) == len(records):
        raise SuiteError(f"lm_eval:{task}: every request failed; first error: [{failed[0]['error_kind']}] {failed[0]['error']}")
    if failed:
        log.warning("lm_eval:%s: %d of %d documents had a failed request; first: %s", task, len(failed), len(records),
                    failed[0]["error"])
    name = f"lm_eval:{task}"
    if list(summary) == [name]:
        return SuiteResult(name, records, summary[name], f"lm-eval task {task}")
    return SuiteResult(name, records, summarize_records(records), f"lm-eval task {task}", by_suite=summary)
