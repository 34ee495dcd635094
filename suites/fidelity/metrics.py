"""Token-level fidelity metrics (numpy, float64).

KL(ref ‖ cand) per position, three ways, from the most to the least information:

* ``kl_full``: both full log-softmax rows (exact).
* ``kl_topk_tail``: the reference's top-k ids and log-probs plus one lumped tail bucket (1 − Σ top-k);
  the candidate's log-probs at the same ids (gathered from its full row) and its own tail mass.  This is
  the KL of a coarsened distribution, so by the data-processing inequality it never exceeds the exact KL,
  and it equals it up to the KL inside the tail (small when the top-k holds almost all the mass).
* ``kl_topk_overlap``: when the candidate only reports its own top-k (an HTTP server), the buckets are the
  ids in both top-k lists plus one bucket for everything else; again a lower bound.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

EPS = 1e-12
ROW_CHUNK = 256  # rows per step over full [T, V] arrays, so memory stays bounded on long texts


def _log_tail(lp: np.ndarray) -> np.ndarray:
    """log(1 − Σ exp(lp)) along the last axis, clamped so an all-covering top-k gives log(EPS)."""
    mass = np.exp(lp).sum(axis=-1)
    return np.log(np.clip(1.0 - mass, EPS, 1.0))


def kl_full(ref_lp: np.ndarray, cand_lp: np.ndarray) -> np.ndarray:
    """Exact KL per row from full log-prob rows ``[T, V]``."""
    ref_lp, cand_lp = np.asarray(ref_lp), np.asarray(cand_lp)
    if ref_lp.shape != cand_lp.shape:
        raise ValueError(f"full rows differ in shape: {ref_lp.shape} vs {cand_lp.shape}")
    if ref_lp.ndim == 1:
        return kl_full(ref_lp[None], cand_lp[None])[0]
    out = np.empty(ref_lp.shape[0])
    for s in range(0, ref_lp.shape[0], ROW_CHUNK):  # float64 temporaries of a few rows, not of a long text
        ref = ref_lp[s:s + ROW_CHUNK].astype(np.float64)
        cand = cand_lp[s:s + ROW_CHUNK].astype(np.float64)
        out[s:s + ROW_CHUNK] = np.maximum((np.exp(ref) * (ref - cand)).sum(axis=-1), 0.0)
    return out


def kl_topk_tail(ref_top_lp: np.ndarray, cand_lp_at_ref: np.ndarray) -> np.ndarray:
    """KL over the reference's top-k support plus one tail bucket; inputs ``[T, k]`` log-probs."""
    p_lp = np.asarray(ref_top_lp, dtype=np.float64)
    q_lp = np.maximum(np.asarray(cand_lp_at_ref, dtype=np.float64), np.log(EPS))
    p_tail, q_tail = _log_tail(p_lp), _log_tail(q_lp)
    kl = (np.exp(p_lp) * (p_lp - q_lp)).sum(axis=-1) + np.exp(p_tail) * (p_tail - q_tail)
    return np.maximum(kl, 0.0)


def kl_topk_overlap(
    ref_ids: Sequence[Sequence[int]], ref_lp: Sequence[Sequence[float]], cand_ids: Sequence[Sequence[int]], cand_lp: Sequence[Sequence[float]]
) -> np.ndarray:
    """KL over the ids present in both top-k lists plus one bucket for the rest, per position."""
    out = np.zeros(len(ref_ids))
    for t, (ri, rl, ci, cl) in enumerate(zip(ref_ids, ref_lp, cand_ids, cand_lp)):
        cmap = dict(zip((int(x) for x in ci), (float(x) for x in cl)))
        common = [(float(l), cmap[int(i)]) for i, l in zip(ri, rl) if int(i) in cmap]
        if not common:
            p_lp, q_lp = np.zeros((1, 0)), np.zeros((1, 0))
        else:
            p_lp, q_lp = np.array([[c[0] for c in common]]), np.array([[c[1] for c in common]])
        out[t] = kl_topk_tail(p_lp, q_lp)[0]
    return out


def first_divergence(ref: Sequence, cand: Sequence, window: int) -> int:
    """Index of the first differing element; ``window`` when the sequences are equal (no divergence
    inside the window); the shorter length when one is a strict prefix of the other."""
    n = min(len(ref), len(cand))
    for i in range(n):
        if ref[i] != cand[i]:
            return i
    return window if len(ref) == len(cand) else n


def p99(x: np.ndarray) -> float:
    return float(np.percentile(x, 99)) if len(x) else 0.0


def item_scores(kl: np.ndarray, top1: np.ndarray, ref_tok_lp: np.ndarray, cand_tok_lp: np.ndarray, divergence: int) -> dict:
    """One text's figures (the ``scores`` of its item record).

    ``kl_mean`` is the text's mean over its ``n_tokens`` tokens, so the suite-level KL mean (over every
    token, ``pooled_summary``) is the ``n_tokens``-weighted mean of these; the report and the gate use that
    one definition (``reports.analysis.fidelity_kl``).  ``kl_p99`` here is this text's own p99: per-text
    percentiles do not combine into the pooled p99, which only ``pooled_summary`` (summary.json) holds."""
    n = int(len(kl))
    nll_ref = float(-np.mean(ref_tok_lp)) if n else 0.0
    nll_cand = float(-np.mean(cand_tok_lp)) if n else 0.0
    return {
        "kl_mean": float(np.mean(kl)) if n else 0.0,
        "kl_p99": p99(kl),
        "kl_max": float(np.max(kl)) if n else 0.0,
        "top1_agree": float(np.mean(top1)) if n else 1.0,
        "nll_ref": nll_ref,
        "nll_cand": nll_cand,
        "ppl_ref": float(np.exp(nll_ref)),
        "ppl_cand": float(np.exp(nll_cand)),
        "first_divergence": float(divergence),
        "n_tokens": float(n),
    }


def pooled_summary(kls: list[np.ndarray], top1s: list[np.ndarray], ref_lps: list[np.ndarray], cand_lps: list[np.ndarray], divs: list[int]) -> dict:
    """Suite-level figures pooled over every token of every text (not a mean of per-text figures): ``kl_mean``
    is the mean KL over every token (= the token-weighted mean of the texts' ``kl_mean``), ``kl_p99`` the
    99th percentile of every token's KL."""
    kl = np.concatenate(kls) if kls else np.zeros(0)
    top1 = np.concatenate(top1s) if top1s else np.zeros(0)
    ref = np.concatenate(ref_lps) if ref_lps else np.zeros(0)
    cand = np.concatenate(cand_lps) if cand_lps else np.zeros(0)
    s = item_scores(kl, top1, ref, cand, 0)
    s["first_divergence"] = float(np.mean(divs)) if divs else 0.0
    s["ppl_delta"] = s["ppl_cand"] - s["ppl_ref"]
    return s


def argmax_ids(top_ids: Optional[np.ndarray], top_lp: Optional[np.ndarray]) -> np.ndarray:
    """The most likely id per row of a top-k table (whatever order it came in)."""
    if top_ids is None or top_lp is None:
        raise ValueError("top-k ids and log-probs are needed")
    top_ids, top_lp = np.asarray(top_ids), np.asarray(top_lp)
    return top_ids[np.arange(len(top_ids)), np.argmax(top_lp, axis=-1)]


# ------------------------------------------------------------------------------ by position

DEFAULT_FIRST_BUCKET = 512


def bucket_edges(max_position: int, spec=None) -> list[int]:
    """Edges 0 = e_0 < e_1 < … of the position buckets [e_i, e_{i+1}) covering positions 0..max_position.

    ``spec`` None or an int B: 0, B, 2B, 4B, … (doubling; default B = 512: 0-512, 512-1k, 1k-2k, 2k-4k, …);
    a list of increasing positive ints: 0 and those edges, then doubling past the last one."""
    if spec is None:
        spec = DEFAULT_FIRST_BUCKET
    if isinstance(spec, bool):
        raise ValueError(f"position_buckets must be a positive int or a list of increasing positive ints, got {spec!r}")
    if isinstance(spec, int):
        if spec <= 0:
            raise ValueError(f"position_buckets must be positive, got {spec}")
        edges = [0, spec]
    else:
        try:
            given = [int(e) for e in spec]
        except (TypeError, ValueError):
            raise ValueError(f"position_buckets must be a positive int or a list of increasing positive ints, got {spec!r}") from None
        if not given or any(e <= 0 for e in given) or any(b <= a for a, b in zip(given, given[1:])) \
                or any(isinstance(e, bool) or float(e) != int(e) for e in spec):
            raise ValueError(f"position_buckets must be a positive int or a list of increasing positive ints, got {spec!r}")
        edges = [0, *given]
    while edges[-1] <= max_position:
        edges.append(edges[-1] * 2)
    return edges


def by_position_sums(kl: np.ndarray, top1: np.ndarray, offset: int, edges: Sequence[int]) -> list[dict]:
    """One text's per-bucket sums (its record's ``by_position``): the continuation token at index i sits at
    absolute position ``offset + i`` (``offset`` = context tokens).  Only buckets holding tokens are listed."""
    kl, top1 = np.asarray(kl, dtype=np.float64), np.asarray(top1, dtype=np.float64)
    if kl.shape != top1.shape:
        raise ValueError(f"kl and top1 differ in shape: {kl.shape} vs {top1.shape}")
    pos = offset + np.arange(kl.size)
    idx = np.searchsorted(np.asarray(edges), pos, side="right") - 1
    out = []
    for b in np.unique(idx):
        m = idx == b
        out.append({"lo": int(edges[b]), "hi": int(edges[b + 1]), "n_tokens": int(m.sum()),
                    "kl_sum": float(kl[m].sum()), "top1_sum": float(top1[m].sum())})
    return out


def pooled_by_position(kls: list[np.ndarray], top1s: list[np.ndarray], offsets: list[int], edges: Sequence[int]) -> list[dict]:
    """Summary ``by_position``: per bucket with tokens, the KL mean, KL p99 and top-1 agreement pooled over every
    token of every text in the bucket (the p99 needs the token values, so this runs where they are)."""
    e = np.asarray(edges)
    kl_b: dict[int, list[np.ndarray]] = {}
    t1_b: dict[int, list[np.ndarray]] = {}
    for kl, top1, off in zip(kls, top1s, offsets):
        kl, top1 = np.asarray(kl, dtype=np.float64), np.asarray(top1, dtype=np.float64)
        idx = np.searchsorted(e, off + np.arange(kl.size), side="right") - 1
        for b in np.unique(idx):
            m = idx == b
            kl_b.setdefault(int(b), []).append(kl[m])
            t1_b.setdefault(int(b), []).append(top1[m])
    out = []
    for b in sorted(kl_b):
        kl = np.concatenate(kl_b[b])
        top1 = np.concatenate(t1_b[b])
        out.append({"lo": int(e[b]), "hi": int(e[b + 1]), "n_tokens": int(kl.size), "kl_mean": float(kl.mean()),
                    "kl_p99": p99(kl), "top1_agree": float(top1.mean())})
    return out
