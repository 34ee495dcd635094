"""Run a generation suite against a ``Client`` concurrently, with a progress bar.

Work units are (item, repeat) pairs submitted to a thread pool of ``opts.concurrency`` workers (the
embedded engine batches concurrent calls; an HTTP client keeps that many requests in flight; a client over N
data-parallel replicas, ``replica_count`` N, gets ``concurrency × N`` workers: ``concurrency`` per replica, and
each record names the replica that served it, ``replica``, from the client's ``served_by()``; when no replica is
left the client raises ``TargetGone`` and the suite stops with it).  Records come
back in dataset order whatever the completion order, and a failed request (it raises, or returns
finish_reason ``error``) becomes a record with ``finish_reason = "error"``, ``error`` (the message) and
``error_kind`` (``core.client.ERROR_KINDS``), no ``correct`` and no scores: counted apart from wrong
answers, and items are never dropped.  When every request fails the suite raises.  Each record also carries
``request_options`` (what it was sent with), ``reasoning`` (text the server returned apart from the answer;
never scored) and ``retries`` (connection retries).  A client with a ``check_request(request)`` method (the
embedded engine) vets the first request before any is sent: options it cannot honour fail the suite at once.
"""

from __future__ import annotations

import logging
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

from kvbench.core import REPLICA_FIELD, Client, GenResult, TargetGone, classify_error
from kvbench.core import prompt_hash
from kvbench.suites.base import (GenerationTask, SuiteError, SuiteOptions, SuiteResult, is_error_record, item_seed,
                                 make_record, replica_width, served_by, summarize_records)

log = logging.getLogger(__name__)


@contextmanager
def progress_bar(total: int, label: str, enabled: bool) -> Iterator[Callable[[], None]]:
    """Yields ``advance()``: a rich progress bar on a terminal, a log line every 10% otherwise."""
    if not enabled:
        yield lambda: None
        return
    if not sys.stderr.isatty():
        done = [0]
        step = max(1, total // 10)

        def advance() -> None:
            done[0] += 1
            if done[0] % step == 0 or done[0] == total:
                log.info("%s: %d/%d done", label, done[0], total)

        yield advance
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda: bar.advance(task)


def run_generation(task: GenerationTask, client: Client, opts: SuiteOptions) -> SuiteResult:
    items, source = task.load_items(opts)
    if opts.limit is not None and not task.applies_limit:
        items = items[: opts.limit]
    if not items:
        raise SuiteError(f"{task.name}: no items to run ({source})")
    ids = [it.item_id for it in items]
    if len(set(ids)) != len(ids):
        raise SuiteError(f"{task.name}: duplicate item ids in {source}")
    protocol = task.protocol(opts)
    units = [(i, k) for i in range(len(items)) for k in range(opts.repeats)]
    records: list[Optional[dict]] = [None] * len(units)
    errors: list[str] = []

    def built(idx: int):
        i, k = units[idx]
        seed = item_seed(opts.seed, task.name, items[i].item_id, k)
        item = task.prepare(items[i], k, seed)
        return i, k, seed, item, task.build(item, k, task.params(opts, seed))

    many = replica_width(client) > 1  # a client over several replicas (harness/replica_client.py)
    check = getattr(client, "check_request", None)
    if callable(check):
        try:
            check(built(0)[-1])
        except ValueError as e:
            raise SuiteError(f"{task.name}: {e}") from None

    def one(idx: int) -> dict:
        i, k, seed, item, req = built(idx)
        result: Optional[GenResult] = None
        error: Optional[str] = None
        kind: Optional[str] = None
        retries: Optional[int] = None
        try:
            result = client.generate(req)
        except TargetGone:  # no replica left: the suite stops (never one item's error)
            raise
        except Exception as e:  # a failed request is recorded, never dropped
            error, kind = f"{type(e).__name__}: {e}", classify_error(e)
            retries = int(getattr(e, "retries", 0) or 0)
        if error is None and (result is None or result.finish_reason == "error"):
            error = (result.error if result is not None else None) or "request failed"
            kind = (result.error_kind if result is not None else None) or "other"
        if error is not None:
            errors.append(f"{item.item_id}/{k}: [{kind}] {error}")
            scored = None
        else:
            scored = task.score(item, result.text)
        record = make_record(task.name, item, k, seed, req, result, scored, protocol, prompt_hash, error, kind, retries)
        for key, value in task.record_fields(item).items():
            record.setdefault(key, value)  # never overrides a make_record field
        if many:  # several replicas: which one served (or last failed) this request
            record[REPLICA_FIELD] = served_by(client)
        return record

    with progress_bar(len(units), task.name, opts.progress) as advance:
        with ThreadPoolExecutor(max_workers=min(opts.concurrency * replica_width(client), len(units))) as pool:
            futures = {pool.submit(one, idx): idx for idx in range(len(units))}
            try:
                for fut in as_completed(futures):
                    records[futures[fut]] = fut.result()
                    advance()
            except TargetGone:
                pool.shutdown(wait=True, cancel_futures=True)
                raise

    if errors:
        log.warning("%s: %d of %d requests failed; first: %s", task.name, len(errors), len(units), errors[0])
        if len(errors) == len(units):
            raise SuiteError(f"{task.name}: every request failed; first error: {errors[0]}")
    done = [r for r in records if r is not None]
    summary = summarize_records(done)
    # suite aggregates (pass@k, by length ...) are over answered records too: a failed request is no answer
    summary.update(task.extra_summary([r for r in done if not is_error_record(r)], opts))
    return SuiteResult(task.name, done, summary, source)
