"""kvbench.harness.sweep: A sweep configuration: its sections (specs), KV and backend axes (axes), the parser (config), the dry
run, hints and the progress display."""

from kvbench.core.lazy import lazy_exports

_EXPORTS = {
    "SweepConfig": "config",
    "SweepConfigError": "config",
    "parse_config": "config",
    "load_config": "config",
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
