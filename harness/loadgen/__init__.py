"""kvbench.harness.loadgen: The load generator: datasets, the streaming HTTP client, repeats, machine load and /metrics sampling."""

from kvbench.core.lazy import lazy_exports

_EXPORTS = {
    "LoadConfig": "run",
    "run_load": "run",
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
