"""kvbench.reports.render: The rendered report: HTML, markdown, plots and the headless-browser screenshot."""

from kvbench.core.lazy import lazy_exports

_EXPORTS = {
    "write_report": "html",
    "ReportMeta": "html",
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
