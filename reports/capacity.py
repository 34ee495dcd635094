"""Planned KV capacity in the terms a measurement uses: how many concurrent requests of the load test's own size
the planned cache holds (whole pages per request, capped by the server's running limit), so the planned and the
measured maximum concurrency count the same requests (the capacity plot, the verdict card)."""

from __future__ import annotations

import math
from typing import Optional

from kvbench.reports.analysis import Analysis
from kvbench.reports.render.plot_style import series_key

__all__ = ["planned_at_request", "load_request_sizes"]


def planned_at_request(cap: dict, request_tokens: int, running_limit: Optional[float] = None) -> Optional[int]:
    """The planned number of concurrent requests of ``request_tokens`` (prompt + output) that the KV cache holds:
    whole pages per request when the plan has them, capped by the server's running limit where known."""
    if request_tokens <= 0:
        return None
    pages, page = cap.get("num_pages"), cap.get("page_size")
    if isinstance(pages, (int, float)) and isinstance(page, (int, float)) and page > 0:
        n = int(pages) // max(1, math.ceil(request_tokens / page))
    elif isinstance(cap.get("tokens"), (int, float)):
        n = int(cap["tokens"]) // request_tokens
    else:
        return None
    if running_limit is not None and math.isfinite(float(running_limit)) and running_limit > 0:
        n = min(n, int(running_limit))
    return n


def load_request_sizes(a: Analysis) -> dict[tuple, tuple[int, Optional[float]]]:
    """series key -> (prompt + output tokens of the load test's requests, the server's running limit)."""
    out: dict[tuple, tuple[int, Optional[float]]] = {}
    for cell, s in a.serving:
        n_in, n_out = s.get("input_len"), s.get("output_len")
        if cell.aa_control or not n_in or not n_out:
            continue
        out[series_key(cell)] = (int(n_in) + int(n_out), s.get("max_running"))
    return out
