"""Token-level fidelity of a candidate configuration against a reference (bf16 KV, torch backend).

Texts (default: GSM8K test questions with their reference solutions, ``Question: q\\nAnswer:`` as context
and `` solution`` as continuation) are teacher-forced through both.  Per text: KL(ref ‖ cand) per token
(mean, p99, max), top-1 agreement, NLL and perplexity of the reference solution under each, and the first
position where greedy continuations of the context differ (``window`` when they agree throughout).

KL is exact over the full vocabulary when the reference runs live next to an in-process candidate
(``exact=True``); otherwise the cached reference top-k plus a lumped tail bucket is used (a lower bound
that is close; tests check it against the exact value); an HTTP candidate reporting only its own top-k
gets the overlap bound.  The method is part of the protocol string.

By position: every record carries ``by_position``, per-bucket sums {lo, hi, n_tokens, kl_sum, top1_sum} over
its tokens' absolute positions (context tokens, taken from the greedy request's prompt token count, plus the
index in the continuation), and the summary a pooled ``by_position`` list {lo, hi, n_tokens, kl_mean,
kl_p99, top1_agree} (buckets 0-512, 512-1k, 1k-2k, … doubling; ``extra["position_buckets"]`` sets the first
edge or a list of edges).  Long texts (``extra["text_tokens"]``, optionally ``extra["haystack_file"]``;
``suites/fidelity/texts.py``) make those positions reach the context lengths that matter.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np

from kvbench.core import Client, ScoreRequest
from kvbench.core import prompt_hash
from kvbench.core import release_memory
from kvbench.core import REPLICA_FIELD
from kvbench.suites.base import SuiteError, SuiteOptions, SuiteResult, pinned, replica_width, served_by, summarize_records
from kvbench.suites.fidelity.metrics import (
    argmax_ids,
    bucket_edges,
    by_position_sums,
    pooled_by_position,
    first_divergence,
    item_scores,
    kl_full,
    kl_topk_overlap,
    kl_topk_tail,
    pooled_summary,
)
from kvbench.suites.fidelity.cache import ReferenceCache, entry_key, max_bytes_from_env
from kvbench.suites.fidelity.ref import (
    API_TOP_K,
    RefText,
    Text,
    compute_reference,
    exact_budget_from_env,
    greedy_request,
    reference_one,
    to_numpy,
)
from kvbench.suites.fidelity.texts import Counter, build_long_texts, long_text_spec, token_counter
from kvbench.suites.gsm8k import load_gsm8k

log = logging.getLogger(__name__)
DEFAULT_TEXTS = 32


@dataclass
class Reference:
    """Where reference figures come from: a label naming the configuration (in the protocol string), a
    factory for its client (called only on a cache miss or for an exact run) and the cache key's view of it,
    ``{"model": identity, "settings": {...}}`` (harness/fidelity_key.py; None: the label alone keys the cache)."""

    label: str
    make_client: Callable[[], Client]
    key: Union[dict, Callable[[], dict], None] = None  # a callable is called once, when the cache is first used

    def cache_identity(self) -> Union[dict, str]:
        """The key's view of the reference (``key``, computed on first use), or the label when there is none."""
        if callable(self.key):
            self.key = self.key()
        return self.key or self.label


def gsm8k_texts(opts: SuiteOptions) -> list[Text]:
    rows, _ = load_gsm8k(opts, "test")
    n = opts.limit or DEFAULT_TEXTS
    return [Text(f"test-{i}", f"Question: {r['question']}\nAnswer:", " " + r["answer"]) for i, r in enumerate(rows[:n])]


@dataclass
class CandidateOut:
    record: dict
    kl: np.ndarray
    top1: np.ndarray
    ref_lp: np.ndarray
    cand_lp: np.ndarray
    divergence: int
    offset: int  # context tokens: the absolute position of the continuation's first token


class FidelitySuite:
    name = "fidelity"

    def __init__(
        self,
        reference: Reference,
        cache_dir: Optional[Path] = None,
        top_k: int = 64,
        greedy_tokens: int = 32,
        exact: bool = False,
        texts: Optional[Callable[[SuiteOptions], list[Text]]] = None,
        count_tokens: Optional[Counter] = None,
    ):
        if top_k <= 0 or greedy_tokens <= 0:
            raise SuiteError("fidelity top_k and greedy_tokens must be positive")
        self.reference, self.cache_dir, self.top_k, self.greedy_tokens, self.exact = reference, cache_dir, top_k, greedy_tokens, exact
        self.texts = texts or gsm8k_texts
        self.count_tokens = count_tokens  # long texts: the target's token count (default: from the client)
        self.texts_label = "gsm8k-solutions"

    def _concurrency(self, opts: SuiteOptions) -> int:
        """Texts in flight (per replica of a data-parallel target): one at a time for long texts, whose full
        log-prob rows are T×V floats each (8k tokens × a 49k vocabulary: 1.6 GB per side), else
        ``opts.concurrency``."""
        return 1 if self.texts_label.startswith("texts=") else opts.concurrency

    def _texts(self, client: Client, opts: SuiteOptions) -> list[Text]:
        """The built-in or given texts; long texts when ``extra["text_tokens"]`` is set (sets ``texts_label``)."""
        spec = long_text_spec(opts)
        if spec is None:
            self.texts_label = "gsm8k-solutions"
            return self.texts(opts)
        if self.texts is not gsm8k_texts:
            raise SuiteError("fidelity: text_tokens builds its own long texts; it does not apply to given texts")
        count = self.count_tokens or token_counter(client, (opts.extra or {}).get("tokenizer"))
        info = client.info() if hasattr(client, "info") else {}
        mml = (info or {}).get("max_model_len")
        texts, label = build_long_texts(opts, spec, count, int(mml) if mml else None)
        self.texts_label = f"texts={label}"
        return texts

    def _cache(self) -> Optional[ReferenceCache]:
        return ReferenceCache(self.cache_dir, max_bytes_from_env()) if self.cache_dir is not None else None

    def _cached_references(self, texts: list[Text], opts: SuiteOptions) -> list[RefText]:
        cache = self._cache()
        if cache is not None:
            ident = self.reference.cache_identity()
            key = entry_key(ident, texts, self.top_k, self.greedy_tokens)
            cached = cache.load(key)
            if cached is not None:
                log.info("fidelity reference from cache %s/%s", self.cache_dir, key.name)
                return cached
            why = cache.explain_miss(key, ident.get("model") if isinstance(ident, dict) else None)
            if why:
                log.warning("fidelity reference: model file changed since the cached reference (%s); rebuilding", why)
        client = self.reference.make_client()
        try:
            refs = compute_reference(client, texts, self.top_k, self.greedy_tokens, False,
                                     self._concurrency(opts) * replica_width(client))
        finally:
            client.close()
            del client
            release_memory()  # the reference engine's weights and cache, before the candidate runs
        self._save(texts, refs)
        return refs

    def _save(self, texts: list[Text], refs: list[RefText]) -> None:
        cache = self._cache()
        if cache is not None:
            ident = self.reference.cache_identity()
            key = entry_key(ident, texts, self.top_k, self.greedy_tokens)
            meta = {"reference": self.reference.label, "reference_key": ident if isinstance(ident, dict) else None,
                    "top_k": self.top_k, "greedy_tokens": self.greedy_tokens, "texts": len(texts)}
            cache.save(key, refs, meta)

    def protocol(self, opts: SuiteOptions, method: str, n: int) -> str:
        return f"kvbench:fidelity:v1:{self.texts_label}:n{n}:ref={self.reference.label}:kl={method}:top{self.top_k}:greedy{self.greedy_tokens}"

    def _one(self, client: Client, text: Text, ref: RefText, opts: SuiteOptions, n: int, buckets) -> CandidateOut:
        """One text on the candidate; over data-parallel replicas its requests go to one replica (``pinned``),
        which the record names (``replica``)."""
        with pinned(client):
            out = self._measure(client, text, ref, opts, n, buckets)
            if replica_width(client) > 1:
                out.record[REPLICA_FIELD] = served_by(client)
        return out

    def _measure(self, client: Client, text: Text, ref: RefText, opts: SuiteOptions, n: int, buckets) -> CandidateOut:
        t0 = time.perf_counter()
        # full rows only for exact KL; otherwise an in-process candidate gathers its log-probs at the reference's
        # top-k ids and its own argmax as it computes rows (no [T, V] tensor); a client that ignores that
        # returns full rows, an API its own top-k
        reduce = ref.full is None
        res = client.score(ScoreRequest(text.context, text.continuation, top_k=min(self.top_k, API_TOP_K), full_distribution=True,
                                        full_top_k=1 if reduce else 0, gather_ids=ref.top_ids if reduce else None))
        if list(res.token_ids) != [int(x) for x in ref.token_ids]:
            raise SuiteError(f"{text.item_id}: candidate tokenizes the text differently from the reference")
        ref_argmax = argmax_ids(ref.top_ids, ref.top_lp)
        extra: dict[str, float] = {}
        gathered = getattr(res, "gathered_logprobs", None)
        if res.full_logprobs is None and gathered is not None and res.top_ids is not None:
            cand_argmax = np.asarray(res.top_ids, dtype=np.int64)[:, 0]
            kl, method = kl_topk_tail(ref.top_lp, to_numpy(gathered)), f"top{ref.top_ids.shape[1]}+tail"
        elif res.full_logprobs is not None:
            full = to_numpy(res.full_logprobs)
            cand_argmax = full.argmax(axis=-1)
            approx = kl_topk_tail(ref.top_lp, np.take_along_axis(full, ref.top_ids, axis=-1))
            if ref.full is not None:
                kl, method = kl_full(ref.full, full), "full"
                extra["kl_mean_topk"] = float(np.mean(approx)) if len(approx) else 0.0
            else:
                kl, method = approx, f"top{ref.top_ids.shape[1]}+tail"
        elif res.top_ids is not None and res.top_logprobs is not None:
            kl, method = kl_topk_overlap(ref.top_ids, ref.top_lp, res.top_ids, res.top_logprobs), "topk-overlap"
            cand_argmax = argmax_ids(np.asarray(res.top_ids), np.asarray(res.top_logprobs))
        else:
            raise SuiteError("the candidate client returned neither full rows nor top-k log-probs from score()")
        top1 = (np.asarray(cand_argmax) == ref_argmax).astype(np.float64)
        gen = client.generate(greedy_request(text, self.greedy_tokens))
        if gen.token_ids is not None and ref.greedy_ids is not None:
            div = first_divergence(ref.greedy_ids, list(gen.token_ids), self.greedy_tokens)
        else:  # no token ids from one side: compare characters, scaled to the window
            method += ";div=chars"
            div = first_divergence(ref.greedy_text, gen.text, len(ref.greedy_text) or 1)
        cand_lp = np.asarray(res.logprobs, dtype=np.float64)
        offset = int(gen.prompt_tokens)
        record = {
            "suite": self.name,
            "item_id": text.item_id,
            "repeat": 0,
            "seed": None,
            "prompt_hash": prompt_hash(text.context + text.continuation),
            "raw_output": gen.text,
            "extracted": None,
            "target": ref.greedy_text,
            "correct": None,
            "invalid": False,
            "finish_reason": gen.finish_reason,
            "prompt_tokens": int(gen.prompt_tokens),
            "output_tokens": int(gen.output_tokens),
            "latency_s": time.perf_counter() - t0,
            "scores": {**item_scores(kl, top1, ref.logprobs, cand_lp, div), **extra},
            "protocol": self.protocol(opts, method, n),
            "by_position": by_position_sums(kl, top1, offset, bucket_edges(offset + len(kl), buckets)),
        }
        return CandidateOut(record, kl, top1, ref.logprobs, cand_lp, div, offset)

    def _run_exact(self, client: Client, texts: list[Text], opts: SuiteOptions, buckets, workers: int) -> list[CandidateOut]:
        """Reference live next to the candidate, full rows on both sides; the rows alive at once are bounded by
        ``KVBENCH_FIDELITY_EXACT_MAX_MB`` (``RowBudget``).  The reference's top-k is cached as usual."""
        try:
            budget = exact_budget_from_env()
        except ValueError as e:
            raise SuiteError(str(e)) from None
        ref_client = self.reference.make_client()
        refs: list[Optional[RefText]] = [None] * len(texts)

        def both(i: int) -> CandidateOut:
            with budget.hold(len(texts[i].context) + len(texts[i].continuation)) as learn:
                ref = reference_one(ref_client, texts[i], self.top_k, self.greedy_tokens, True)
                learn(2 * int(getattr(ref.full, "nbytes", 0)))  # the candidate's rows are as large
                out = self._one(client, texts[i], ref, opts, len(texts), buckets)
                ref.full = None
            refs[i] = ref
            return out

        try:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                outs = list(pool.map(both, range(len(texts))))
        finally:
            ref_client.close()
            del ref_client
            release_memory()
        self._save(texts, [r for r in refs if r is not None])
        return outs

    def run(self, client: Client, opts: SuiteOptions) -> SuiteResult:
        texts = self._texts(client, opts)
        if not texts:
            raise SuiteError("fidelity: no texts")
        buckets = (opts.extra or {}).get("position_buckets")
        try:  # the edges are one sequence whatever the length they cover: checked once here
            bucket_edges(0, buckets)
        except ValueError as e:
            raise SuiteError(f"fidelity: {e}") from None
        workers = max(1, min(self._concurrency(opts) * replica_width(client), len(texts)))  # per replica
        if self.exact:  # reference live, text by text, so full rows of only a few texts are alive at once
            outs = self._run_exact(client, texts, opts, buckets, workers)
        else:
            refs_c = self._cached_references(texts, opts)
            if [r.item_id for r in refs_c] != [t.item_id for t in texts]:
                raise SuiteError("fidelity: reference cache does not match the texts")
            with ThreadPoolExecutor(max_workers=workers) as pool:
                outs = list(pool.map(lambda tr: self._one(client, tr[0], tr[1], opts, len(texts), buckets), zip(texts, refs_c)))
        records = [o.record for o in outs]
        summary = summarize_records(records)
        summary.update(pooled_summary([o.kl for o in outs], [o.top1 for o in outs], [o.ref_lp for o in outs], [o.cand_lp for o in outs], [o.divergence for o in outs]))
        edges = bucket_edges(max(o.offset + len(o.kl) for o in outs), buckets)
        summary["by_position"] = pooled_by_position([o.kl for o in outs], [o.top1 for o in outs], [o.offset for o in outs], edges)
        summary["n"] = len(records)
        if all("kl_mean_topk" in r["scores"] for r in records):  # exact run: the approximation, token-weighted too
            w = [r["scores"]["n_tokens"] for r in records]
            summary["kl_mean_topk"] = sum(r["scores"]["kl_mean_topk"] * n for r, n in zip(records, w)) / max(sum(w), 1.0)
        source = "gsm8k test solutions" if self.texts_label == "gsm8k-solutions" else f"long texts ({self.texts_label})"
        return SuiteResult(self.name, records, summary, source)
