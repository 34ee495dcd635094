"""Diagnostics inside sweep and eval cells: the ``diagnostics:`` key of a sweep config (``--diagnose`` on eval).

    diagnostics:
      limit: 4           # fidelity texts (default 4)
      text_tokens: 2048  # long texts instead of single GSM8K solutions (optional)
      kl_limit: 0.01     # also suggest (and measure) a skip set (optional)
      leave_one_out: true

Every accuracy cell of an embedded target whose KV format is quantized (the A/A control and bf16 cells are
left out) runs ``harness/diagnose.run_diagnosis`` on its own engine's loaded model after its suites, and
stores ``cells/<key>/diagnostics.json``; the sweep report draws its heatmaps.  Server and endpoint targets
have no per-layer view of their cache: their cells carry no diagnostics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from kvbench.harness.config_checks import _bool, _check_keys, _fail, _int, _mapping, _num

__all__ = ["DiagnosticsSpec", "parse_diagnostics", "wants_diagnostics", "run_cell_diagnostics", "brief"]

DIAG_KEYS = ("limit", "text_tokens", "haystack_file", "kl_limit", "leave_one_out")


@dataclass(frozen=True)
class DiagnosticsSpec:
    limit: int = 4
    text_tokens: Optional[int] = None
    haystack_file: Optional[str] = None
    kl_limit: Optional[float] = None
    leave_one_out: bool = True


def parse_diagnostics(d: Any, path: str = "diagnostics") -> Optional[DiagnosticsSpec]:
    """None (no diagnostics), ``true`` (the defaults) or a mapping of ``DIAG_KEYS``."""
    if d is None or d is False:
        return None
    if d is True:
        return DiagnosticsSpec()
    d = _mapping(d, path)
    _check_keys(d, DIAG_KEYS, path)
    kl = None if d.get("kl_limit") is None else _num(d["kl_limit"], f"{path}.kl_limit", 0.0)
    loo = _bool(d.get("leave_one_out", True), f"{path}.leave_one_out")
    if kl is not None and not loo:
        _fail(f"{path}.kl_limit", "a suggestion ranks layers by their leave-one-out KL contribution; keep leave_one_out on")
    hay = d.get("haystack_file")
    if hay is not None and not isinstance(hay, str):
        _fail(f"{path}.haystack_file", f"expected a file path, got {hay!r}")
    return DiagnosticsSpec(
        limit=_int(d.get("limit", 4), f"{path}.limit", 1),
        text_tokens=None if d.get("text_tokens") is None else _int(d["text_tokens"], f"{path}.text_tokens", 16),
        haystack_file=hay, kl_limit=kl, leave_one_out=loo,
    )


def wants_diagnostics(spec: Optional[DiagnosticsSpec], cell_config: dict, client) -> bool:
    """A quantized, non-A/A accuracy cell on an embedded engine."""
    from kvbench.core import get_spec

    if spec is None or cell_config.get("aa_control"):
        return False
    if getattr(client, "engine", None) is None or not hasattr(client.engine, "parts"):
        return False
    quantized = get_spec(cell_config["kv_dtype"]).quantized or bool((cell_config.get("options") or {}).get("kv_layer_dtypes"))
    return quantized


def run_cell_diagnostics(spec: DiagnosticsSpec, client, data_dir: Optional[str], progress=None) -> dict:
    """The diagnosis of the cell's engine (its configuration, model and scales policy) on fidelity texts."""
    from kvbench.harness.diagnose import DiagnoseSettings, diagnosis_texts, run_diagnosis

    engine = client.engine
    ids, label = diagnosis_texts(engine.tokenizer, client, spec.limit, data_dir, spec.text_tokens, spec.haystack_file,
                                 engine.max_model_len)
    # capacity rows in the cell engine's own budget and context (free GPU memory is smaller while it runs)
    settings = DiagnoseSettings(kl_limit=spec.kl_limit, leave_one_out=spec.leave_one_out, label=label,
                                budget_bytes=engine.capacity.extra.get("kv_budget_bytes"), context_len=engine.max_model_len)
    return run_diagnosis(engine.config, ids, settings, loaded=engine.parts.loaded, progress=progress, scales=engine.scales)


def brief(diag: dict) -> dict:
    """What a cell's summary keeps of its diagnosis: full KL, the top layers, the suggestion."""
    layers = [d for d in diag.get("layers", []) if d.get("kl_contribution") is not None]
    top = sorted(layers, key=lambda d: -d["kl_contribution"])[:3]
    s = diag.get("suggestion") or {}
    return {"kl": diag["kl"]["full"], "top_layers": [d["layer"] for d in top],
            "suggested_skip_layers": s.get("skip_layers"), "suggested_kl": s.get("kl"), "runs": diag.get("runs")}
