"""Fidelity by position: KL mean / p99 and top-1 agreement per position bucket, from a cell's fidelity
records (each carries ``by_position`` sums) and its summary (``by_position`` with the pooled p99).

The bucket means are re-pooled from the records' sums (Σ KL / tokens, Σ top-1 / tokens over every text),
so they are token-weighted over the whole cell.  A percentile does not re-pool from per-text figures:
the p99 comes from the fidelity summary of the same run, which pooled the token KL values of the bucket;
it is used only when the summary's token count of the bucket equals the records' (else NaN, shown "—").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from kvbench.reports.load import FIDELITY_SUITE, CellData

__all__ = ["Bucket", "PositionRow", "position_row", "bucket_label"]


def _k(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def bucket_label(lo: int, hi: int) -> str:
    """0, 512 -> "0–512"; 1024, 2048 -> "1k–2k"."""
    return f"{_k(lo)}–{_k(hi)}"


@dataclass(frozen=True)
class Bucket:
    lo: int
    hi: int  # exclusive
    n_tokens: int
    kl_mean: float
    kl_p99: float  # NaN when the summary has no matching pooled p99
    top1_agree: float

    @property
    def label(self) -> str:
        return bucket_label(self.lo, self.hi)


@dataclass
class PositionRow:
    cell: CellData
    buckets: list[Bucket]


def _num(v) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def position_row(cell: CellData) -> Optional[PositionRow]:
    sums: dict[tuple[int, int], list[float]] = {}  # (lo, hi) -> [tokens, kl_sum, top1_sum]
    for rec in cell.items:
        if rec.get("suite") != FIDELITY_SUITE:
            continue
        for b in rec.get("by_position") or []:
            lo, hi, n = _num(b.get("lo")), _num(b.get("hi")), _num(b.get("n_tokens"))
            kl, t1 = _num(b.get("kl_sum")), _num(b.get("top1_sum"))
            if None in (lo, hi, n, kl, t1) or n <= 0:
                continue
            acc = sums.setdefault((int(lo), int(hi)), [0.0, 0.0, 0.0])
            acc[0] += n
            acc[1] += kl
            acc[2] += t1
    summary = (((cell.summary or {}).get("suites") or {}).get(FIDELITY_SUITE) or {}).get("by_position") or []
    pooled = {}
    for b in summary:
        lo, hi = _num(b.get("lo")), _num(b.get("hi"))
        if lo is not None and hi is not None:
            pooled[(int(lo), int(hi))] = b
    if not sums:  # records without sums (older runs): the summary alone
        out = []
        for (lo, hi), b in sorted(pooled.items()):
            n, m, p, t = (_num(b.get(k)) for k in ("n_tokens", "kl_mean", "kl_p99", "top1_agree"))
            if n and m is not None and t is not None:
                out.append(Bucket(lo, hi, int(n), m, math.nan if p is None else p, t))
        return PositionRow(cell, out) if out else None
    out = []
    for (lo, hi), (n, kl, t1) in sorted(sums.items()):
        s = pooled.get((lo, hi)) or {}
        p99 = _num(s.get("kl_p99"))
        if _num(s.get("n_tokens")) != n:
            p99 = None  # the summary covers other texts than the records: do not mix them
        out.append(Bucket(lo, hi, int(n), kl / n, math.nan if p99 is None else p99, t1 / n))
    return PositionRow(cell, out)
