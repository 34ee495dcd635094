"""kvbench.reports.stats: Statistics: paired deltas and their intervals, significance, the bootstrap, AUC over lengths."""

from kvbench.core.lazy import lazy_exports

_EXPORTS = {
    "paired_delta": "paired",
    "Estimate": "intervals",
    "PairedDelta": "paired",
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
