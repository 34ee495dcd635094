"""Serving metrics from per-request load-test records (docs/design.md §9): re-exported from
``kvbench.core.serving_metrics`` (reports recompute summaries from the store with the same functions)."""

from __future__ import annotations

from kvbench.core.serving_metrics import (  # noqa: F401
    PERCENTILES,
    chunk_times,
    describe_ms,
    meets_slo,
    peak_concurrency,
    peak_output_throughput,
    percentile,
    summarize,
    tpot_of,
)
