"""The fidelity reference pass and its cache.

The reference configuration (bf16 KV, torch backend, same model, device and compute dtype) teacher-forces
each text once and keeps, per continuation position, the top-k token ids and log-probs (the tail mass is
1 − their sum), the log-prob of the actual token, and a greedy continuation of the text's prefix.  That is
stored once per (model, reference config, texts, k, greedy length) as ``<key>.npz`` (no pickle) plus
``<key>.json`` (written last: its presence marks a complete entry).
"""

from __future__ import annotations

import hashlib
import io
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from kvbench.core.client import Client, GenRequest, SamplingParams, ScoreRequest
from kvbench.core.io import atomic_write_bytes, atomic_write_json

CACHE_VERSION = 1
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
    # full rows when the client has them (top-k taken here); else the API's own top-k (at most API_TOP_K)
    res = client.score(ScoreRequest(text.context, text.continuation, top_k=min(top_k, API_TOP_K), full_distribution=True))
    if res.full_logprobs is not None:
        full = to_numpy(res.full_logprobs)
        top_ids, top_lp = topk_from_full(full, top_k)
    elif res.top_ids is not None and res.top_logprobs is not None:
        full = None
        top_ids, top_lp = np.asarray(res.top_ids, dtype=np.int64), np.asarray(res.top_logprobs, dtype=np.float64)
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


def cache_key(ref_label: str, texts: list[Text], top_k: int, greedy_tokens: int) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"v": CACHE_VERSION, "ref": ref_label, "k": top_k, "g": greedy_tokens}, sort_keys=True).encode())
    for t in texts:
        h.update(json.dumps([t.item_id, t.context, t.continuation]).encode())
    return h.hexdigest()[:20]


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
