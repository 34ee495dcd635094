"""kvbench.reports: run directories read into tables, statistics (reports/stats/), the gate (reports/gate/), and
the rendered report (reports/render/).  Entry point: the names below."""

# The package's entry point: the names other packages use, each from the module that defines it, imported
# when first asked for (kvbench.core.lazy_exports), so importing the package costs nothing.
from kvbench.core.lazy import lazy_exports

_EXPORTS = {
    "compare_analysis": "compare",
    "load_runs": "compare",
    "report_analysis": "compare",
    "run_meta": "compare",
    "GATE_COLUMNS": "gate.check",
    "GateError": "gate.check",
    "GateThresholds": "gate.check",
    "check_row": "gate.check",
    "format_table": "gate.check",
    "merge_gate_config": "gate.check",
    "run_gate": "gate.check",
    "summary_line": "gate.check",
    "to_json": "gate.check",
    "format_plan": "gate.plan",
    "plan_result": "gate.plan",
    "RunLoadError": "load",
    "load_run": "load",
    "selector_text": "load",
    "ReportMeta": "render.html",
    "diff_runs": "run_diff",
    "format_diff": "run_diff",
    "series_label": "tables",
    "build_verdicts": "verdict",
    "verdict_records": "verdict",
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
