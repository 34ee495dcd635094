"""The fidelity reference pass and its cache.

The reference configuration (bf16 KV, torch backend, same model, device and compute dtype) teacher-forces
each text once and keeps, per continuation position, the top-k token ids and log-probs (the tail mass is
1 − their sum), the log-prob of the actual token, and a greedy continuation of the text's prefix.  That is
stored once per (model identity, reference config, texts, k, greedy length) as ``<key>.npz`` (no pickle)
plus ``<key>.json`` (written last: its presence marks a complete entry); suites/fidelity/cache.py keys,
caps and evicts the entries.

Memory: only top-k rows are kept.  The request asks an in-process client for the top-k and its rows are
reduced in the engine as they are computed (``ScoreRequest.full_top_k``); full [T, V] rows (``RefText.full``)
exist only in an exact run, one text per worker at a time.
"""

from __future__ import annotations

import io
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np

from kvbench.core import Client, GenRequest, SamplingParams, ScoreRequest
from kvbench.core import atomic_write_bytes, atomic_write_json

CACHE_VERSION = 2  # 2: keyed by the model's identity (suites/fidelity/cache.py)
API_TOP_K = 20  # most top log-probs an OpenAI-style API (and the engine's sampler) returns per position


@dataclass
class Text:
    item_id: str
    context: str
    continuation: str


@dataclass
class RefText:
    item_id: str
    token_ids: np.ndarray  # [T] continuation ids
    logprobs: np.ndarray  # [T] log p(actual token)
    top_ids: np.ndarray  # [T, k]
    top_lp: np.ndarray  # [T, k]
    greedy_ids: Optional[list[int]]
    greedy_text: str
    full: Optional[np.ndarray] = None  # [T, V] only in a live (uncached) exact run


def to_numpy(x, dtype=np.float32) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor; torch itself is not imported here
        x = x.detach().to("cpu").float().numpy()
    return np.asarray(x, dtype=dtype)


def topk_from_full(full: np.ndarray, k: int, chunk: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """Top-k ids and values per row, largest first; in row chunks (argpartition's [rows, V] index array of a
    long text would otherwise be several GB)."""
    k = min(k, full.shape[-1])
    ids, vals = [], []
    for s in range(0, full.shape[0], chunk):
        rows = full[s:s + chunk]
        idx = np.argpartition(-rows, k - 1, axis=-1)[:, :k]
        v = np.take_along_axis(rows, idx, axis=-1)
        order = np.argsort(-v, axis=-1, kind="stable")
        ids.append(np.take_along_axis(idx, order, axis=-1))
        vals.append(np.take_along_axis(v, order, axis=-1))
    if not ids:
        return np.zeros((0, k), dtype=np.int64), np.zeros((0, k), dtype=full.dtype)
    return np.concatenate(ids), np.concatenate(vals)


def greedy_request(text: Text, n: int) -> GenRequest:
    return GenRequest(prompt=text.context, params=SamplingParams(max_tokens=n, temperature=0.0))


def reference_one(client: Client, text: Text, top_k: int, greedy_tokens: int, keep_full: bool) -> RefText:
    # an in-process client takes the top-k as it computes rows (full rows only when kept: exact runs); a
    # client that only knows full rows returns them (top-k taken here); an API returns its own top-k (<= API_TOP_K)
    res = client.score(ScoreRequest(text.context, text.continuation, top_k=min(top_k, API_TOP_K), full_distribution=True,
                                    full_top_k=0 if keep_full else top_k))
    if res.full_logprobs is not None:
        full = to_numpy(res.full_logprobs)
        top_ids, top_lp = topk_from_full(full, top_k)
    elif res.top_ids is not None and res.top_logprobs is not None:
        full = None
        top_ids = np.asarray(res.top_ids, dtype=np.int64)[:, :top_k]
        top_lp = np.asarray(res.top_logprobs, dtype=np.float64)[:, :top_k]
    else:
        raise RuntimeError("the reference client returned neither full rows nor top-k log-probs from score()")
    if keep_full and full is None:
        raise RuntimeError("exact KL needs full log-prob rows from the reference client (an in-process engine)")
    gen = client.generate(greedy_request(text, greedy_tokens))
    return RefText(
        text.item_id,
        np.asarray(res.token_ids, dtype=np.int64),
        np.asarray(res.logprobs, dtype=np.float64),
        top_ids.astype(np.int64),
        top_lp.astype(np.float64),
        list(gen.token_ids) if gen.token_ids is not None else None,
        gen.text,
        full if keep_full else None,
    )


def compute_reference(client: Client, texts: list[Text], top_k: int, greedy_tokens: int, keep_full: bool, concurrency: int) -> list[RefText]:
    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(texts)))) as pool:
        return list(pool.map(lambda t: reference_one(client, t, top_k, greedy_tokens, keep_full), texts))


def save_reference(cache_dir: Path, key: str, refs: list[RefText], meta: dict) -> None:
    lens = [len(r.token_ids) for r in refs]
    arrays = {
        "offsets": np.cumsum([0] + lens).astype(np.int64),
        "token_ids": np.concatenate([r.token_ids for r in refs]).astype(np.int64),
        "logprobs": np.concatenate([r.logprobs for r in refs]).astype(np.float64),
        "top_ids": np.concatenate([r.top_ids for r in refs]).astype(np.int64),
        "top_lp": np.concatenate([r.top_lp for r in refs]).astype(np.float64),
    }
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    atomic_write_bytes(Path(cache_dir) / f"{key}.npz", buf.getvalue())
    items = [{"item_id": r.item_id, "greedy_ids": r.greedy_ids, "greedy_text": r.greedy_text} for r in refs]
    atomic_write_json(Path(cache_dir) / f"{key}.json", {**meta, "version": CACHE_VERSION, "items": items})


def load_reference(cache_dir: Path, key: str) -> Optional[list[RefText]]:
    meta_p, npz_p = Path(cache_dir) / f"{key}.json", Path(cache_dir) / f"{key}.npz"
    if not (meta_p.exists() and npz_p.exists()):
        return None
    meta = json.loads(meta_p.read_text())
    if meta.get("version") != CACHE_VERSION:
        return None
    with np.load(npz_p, allow_pickle=False) as z:
        a = {k: z[k] for k in z.files}
    off = a["offsets"]
    out = []
    for i, it in enumerate(meta["items"]):
        s, e = int(off[i]), int(off[i + 1])
        out.append(RefText(it["item_id"], a["token_ids"][s:e], a["logprobs"][s:e], a["top_ids"][s:e], a["top_lp"][s:e], it["greedy_ids"], it["greedy_text"]))
    return out


EXACT_MAX_MB_ENV = "KVBENCH_FIDELITY_EXACT_MAX_MB"
DEFAULT_EXACT_MAX_MB = 1024


class RowBudget:
    """Bounds the full log-prob rows alive at once in an exact run (reference and candidate rows of every text
    in flight).  A text waits until its estimate (bytes per character of the texts seen so far times its own
    characters) fits beside the texts in flight; the first text runs alone (nothing is known yet), and a
    text always runs when nothing else is in flight, however large."""

    def __init__(self, cap_bytes: int):
        self.cap, self.held, self.per_char = cap_bytes, 0, None
        self._cond = threading.Condition()

    def _need(self, chars: int) -> int:
        return self.cap if self.per_char is None else int(self.per_char * chars)

    @contextmanager
    def hold(self, chars: int) -> Iterator[Callable[[int], None]]:
        """Hold the estimate of a ``chars``-character text; yields ``learn(nbytes)`` (its rows' real bytes)."""
        with self._cond:
            while self.held and self.held + self._need(chars) > self.cap:
                self._cond.wait()
            need = self._need(chars)
            self.held += need

        def learn(nbytes: int) -> None:
            with self._cond:
                self.per_char = max(self.per_char or 0.0, nbytes / max(chars, 1))

        try:
            yield learn
        finally:
            with self._cond:
                self.held -= need
                self._cond.notify_all()


def exact_budget_from_env() -> RowBudget:
    import os

    raw = os.environ.get(EXACT_MAX_MB_ENV, "").strip()
    try:
        mb = float(raw) if raw else float(DEFAULT_EXACT_MAX_MB)
    except ValueError:
        raise ValueError(f"{EXACT_MAX_MB_ENV}={raw!r} is not a number of megabytes") from None
    if mb <= 0:
        raise ValueError(f"{EXACT_MAX_MB_ENV} must be a positive number of megabytes, got {raw}")
    return RowBudget(int(mb * 2**20))
