"""The report section of a KV error diagnostics file (``diagnostics.json``, ``reports.diagnostics_plots``):
"Where the error comes from: <model> <kv_dtype>" — a summary paragraph, the figures, the layers that matter
most, the skip-layer suggestion with what it costs in capacity, and the command that confirms it.

``render_markdown`` / ``render_html`` give the section (for ``kvbench report`` of a sweep whose cells hold a
``diagnostics.json``: ``sweep_sections``); ``write_report`` writes a standalone report.md, report.html
(self-contained, PNGs inlined) and the PNGs (``kvbench diagnose --out DIR``).
"""

from __future__ import annotations

import html
import logging
import math
import tempfile
from pathlib import Path
from typing import Iterable, Optional, Union

from kvbench.core import atomic_write_text
from kvbench.reports.render.diagnostics_plots import (DIAGNOSTICS_SCHEMA, heads_matrix, layer_mean, layer_rows,
                                               skip_layer_indices, write_diagnostics_plots)
from kvbench.reports.render.html_style import CSS as _CSS
from kvbench.reports.render.html_style import img as _img
from kvbench.reports.tables import Table, fmt_num

__all__ = ["section_title", "summary_text", "top_layers", "top_layers_table", "capacity_table", "render_markdown",
           "render_html", "write_report", "sweep_sections", "TOP_LAYERS"]

log = logging.getLogger("kvbench.report")

TOP_LAYERS = 5  # rows of the top-layers table
_FIG_ORDER = ("kl_contribution", "kv_error", "attn_error", "saturation", "flushed")

# a paragraph is a list of (style, text) runs: "t" plain, "b" bold, "c" code
Run = tuple[str, str]


def _num(v) -> float:
    try:
        return float(v) if v is not None else math.nan
    except (TypeError, ValueError):
        return math.nan


def _g(x: float, digits: int = 3) -> str:
    return "—" if x is None or math.isnan(x) else f"{x:.{digits}g}"


def _pct(x: float, digits: int = 2) -> str:
    if x is None or math.isnan(x):
        return "—"
    return "0%" if x == 0 else f"{100 * x:.{digits}g}%"


def section_title(diag: dict) -> str:
    from kvbench.reports.render.diagnostics_plots import short_model

    return f"Where the error comes from: {short_model(diag.get('model', '?'), 60)} {diag.get('kv_dtype', '?')}"


def _full_kl(diag: dict) -> float:
    return _num((diag.get("kl") or {}).get("full"))


def _fmt(diag: dict, row: dict) -> str:
    fmts = diag.get("layer_dtypes") or []
    i = int(row.get("layer", 0))
    return str(row.get("format") or (fmts[i] if i < len(fmts) else diag.get("kv_dtype")))


def top_layers(diag: dict, n: int = TOP_LAYERS) -> list[dict]:
    """The ``n`` layers with the largest KL contribution (by attention-output error when no layer has one)."""
    rows = layer_rows(diag)
    if any(not math.isnan(_num(r.get("kl_contribution"))) for r in rows):
        key = lambda r: -_num(r.get("kl_contribution")) if not math.isnan(_num(r.get("kl_contribution"))) else math.inf
    else:
        key = lambda r: -layer_mean(r, "attn") if not math.isnan(layer_mean(r, "attn")) else math.inf
    return sorted(rows, key=lambda r: (key(r), int(r.get("layer", 0))))[:n]


def _kv_means(diag: dict) -> tuple[float, float]:
    """Mean K and V relative error over the heads of the layers in the cache's format (all layers if none)."""
    kv = str(diag.get("kv_dtype"))
    rows = [r for r in layer_rows(diag) if _fmt(diag, r) == kv] or layer_rows(diag)
    k = [layer_mean(r, "k") for r in rows]
    v = [layer_mean(r, "v") for r in rows]
    k, v = [x for x in k if not math.isnan(x)], [x for x in v if not math.isnan(x)]
    return (sum(k) / len(k) if k else math.nan), (sum(v) / len(v) if v else math.nan)


def _hotspots(diag: dict, key: str) -> list[tuple[float, str, int, int]]:
    """[(share, "K"/"V", layer, head)] with a nonzero share of ``key`` values, largest first."""
    out = []
    layers = [int(r["layer"]) for r in layer_rows(diag)]
    for part in ("k", "v"):
        m = heads_matrix(diag, part, key)
        for i, layer in enumerate(layers):
            for h in range(m.shape[1]):
                if m[i, h] > 0:
                    out.append((float(m[i, h]), part.upper(), layer, h))
    return sorted(out, key=lambda t: (-t[0], t[2], t[3], t[1]))


def summary_text(diag: dict) -> list[Run]:
    """The summary paragraph: full KL, the top 3 layers by contribution with their share, which of K and V
    dominates, and where values saturated or flushed to zero."""
    out: list[Run] = []
    texts = diag.get("texts") or {}
    kl = diag.get("kl") or {}
    full = _full_kl(diag)
    where = (f" over {fmt_num(texts.get('n'))} texts ({fmt_num(texts.get('tokens'))} tokens"
             f"{', ' + str(texts['label']) if texts.get('label') else ''})" if texts else "")
    if math.isnan(full):
        out.append(("t", f"KL against the bf16 reference was not measured{where}. "))
    else:
        t1 = _num(kl.get("top1_agree"))
        out += [("t", f"Teacher-forced{where}, the {diag.get('kv_dtype')} cache gives KL(reference ‖ candidate) "),
                ("b", f"{_g(full, 4)} nats/token"),
                ("t", (f" (top-1 agreement {100 * t1:.2f}%). " if not math.isnan(t1) else ". "))]
    contrib = [(int(r["layer"]), _num(r.get("kl_contribution"))) for r in layer_rows(diag)
               if not math.isnan(_num(r.get("kl_contribution")))]
    if contrib:
        top = sorted(contrib, key=lambda t: (-t[1], t[0]))[:3]
        parts = []
        for layer, c in top:
            share = f", {100 * c / full:.0f}% of the full KL" if not math.isnan(full) and full > 0 else ""
            parts.append(f"layer {layer} ({_g(c)}{share})")
        out += [("t", "Largest leave-one-out contributions: "), ("b", "; ".join(parts)), ("t", ". ")]
        neg = [layer for layer, c in contrib if c < 0]
        if neg:
            out.append(("t", f"{len(neg)} layer{'s' if len(neg) > 1 else ''} ({', '.join(map(str, neg[:8]))}"
                             f"{', …' if len(neg) > 8 else ''}) contribute{'s' if len(neg) == 1 else ''} negatively: "
                             "keeping only that layer in bf16 does not lower the KL. "))
    elif not math.isnan(full):
        out.append(("t", "No per-layer KL contribution was measured. "))
    k, v = _kv_means(diag)
    if not (math.isnan(k) or math.isnan(v)):
        if max(k, v) > 0 and abs(k - v) <= 0.1 * max(k, v):
            out.append(("t", f"K and V errors are comparable (mean relative error K {_g(k)}, V {_g(v)}). "))
        elif max(k, v) > 0:
            big, small, bn, sn = (k, v, "K", "V") if k > v else (v, k, "V", "K")
            ratio = f", {big / small:.1f}×" if small > 0 else ""
            out += [("b", f"{bn} error dominates"),
                    ("t", f": mean relative error {bn} {_g(big)} vs {sn} {_g(small)}{ratio}. ")]
    for key, word in (("saturated", "saturated (clipped at the format's largest value)"),
                      ("flushed", "flushed to zero")):
        spots = _hotspots(diag, key)
        if spots:
            layers = sorted({s[2] for s in spots})
            worst = ", ".join(f"{p} layer {l} head {h}: {_pct(s)}" for s, p, l, h in spots[:3])
            out.append(("t", f"Values {word} in {len(spots)} layer × head slot{'s' if len(spots) > 1 else ''} "
                             f"(layer{'s' if len(layers) > 1 else ''} {', '.join(map(str, layers[:10]))}"
                             f"{', …' if len(layers) > 10 else ''}); most: {worst}. "))
    if not _hotspots(diag, "saturated") and not _hotspots(diag, "flushed"):
        out.append(("t", "No value saturated or flushed to zero."))
    return out


def top_layers_table(diag: dict, n: int = TOP_LAYERS) -> Table:
    full = _full_kl(diag)
    rows = []
    for r in top_layers(diag, n):
        c = _num(r.get("kl_contribution"))
        sat_k, sat_v = layer_mean(r, "k", "saturated"), layer_mean(r, "v", "saturated")
        sat = "—" if math.isnan(sat_k) and math.isnan(sat_v) else f"{_pct(sat_k)} / {_pct(sat_v)}"
        rows.append([str(r.get("layer")), _fmt(diag, r), _g(layer_mean(r, "k")), _g(layer_mean(r, "v")),
                     _g(layer_mean(r, "attn")), sat, _g(c, 4),
                     f"{100 * c / full:.1f}%" if not (math.isnan(c) or math.isnan(full) or full <= 0) else "—"])
    by = "KL contribution" if any(not math.isnan(_num(r.get("kl_contribution"))) for r in layer_rows(diag)) \
        else "attention-output error (no KL contribution measured)"
    return Table((f"Top {len(rows)} layers" if len(rows) > 1 else "Top layer") + f" by {by}", ["layer", "format", "K err", "V err", "attn err", "sat % (K / V)",
                                                     "KL contribution", "share of KL"], rows,
                 note="Errors are relative (‖x̂ − x‖ / ‖x‖), averaged over the kv heads of the layer; attn err is the "
                      "attention output's. KL contribution: KL of the full candidate minus KL with only that layer in "
                      "bf16 (nats/token, leave-one-out: contributions do not add up to the full KL and can be negative).")


def _cap_rows(diag: dict) -> tuple[list[dict], Optional[dict]]:
    cap = ((diag.get("suggestion") or {}).get("capacity") or {})
    rows = list(cap.get("rows") or [])
    uniform = next((r for r in rows if r.get("name") == diag.get("kv_dtype")), None)
    return rows, uniform


def capacity_table(diag: dict) -> Table:
    rows, uniform = _cap_rows(diag)
    cap = (diag.get("suggestion") or {}).get("capacity") or {}
    base = _num((uniform or {}).get("tokens"))
    out = []
    for r in rows:
        t = _num(r.get("tokens"))
        rel = "—" if math.isnan(base) or base <= 0 or math.isnan(t) else \
            ("0%" if t == base else f"{100 * (t / base - 1):+.1f}%".replace("-", "−"))
        out.append([str(r.get("name")), fmt_num(_num(r.get("bytes_per_token")), 0), fmt_num(r.get("tokens")),
                    fmt_num(r.get("max_concurrency")), rel])
    budget = _num(cap.get("budget_bytes"))
    note = (f"Same KV budget ({budget / 2**30:.2f} GiB) for every row; max concurrency at a "
            f"{fmt_num(cap.get('context_len'))}-token context." if not math.isnan(budget) else "")
    return Table("Capacity with the suggested skip set",
                 ["KV formats", "bytes/token", "tokens", "max concurrency", f"tokens vs uniform {diag.get('kv_dtype')}"],
                 out, note=note)


def _suggestion_text(diag: dict) -> list[Run]:
    sug = diag.get("suggestion")
    if not sug:
        return [("t", "No skip-layer suggestion in this diagnostics file.")]
    skip, limit, kl_after = sug.get("skip_layers"), _num(sug.get("limit")), _num(sug.get("kl"))
    full = _full_kl(diag)
    verdict = "within the limit" if sug.get("met") else "still above the limit"
    if not skip:
        return [("t", f"No layer needs to stay in bf16: KL {_g(full, 4)} is {verdict} {_g(limit)}.")]
    n = len(skip_layer_indices(diag)) or None
    out: list[Run] = [("t", "Keep layers "), ("c", str(skip)), ("t", f"{f' ({n})' if n else ''} in bf16: KL "),
                      ("b", f"{_g(full, 4)} → {_g(kl_after, 4)}"), ("t", f" nats/token, {verdict} {_g(limit)}. ")]
    rows, uniform = _cap_rows(diag)
    mixed = next((r for r in rows if str(r.get("name", "")).startswith(f"{diag.get('kv_dtype')} skip")), None)
    if uniform and mixed and _num(uniform.get("tokens")) > 0:
        t0, t1 = _num(uniform["tokens"]), _num(mixed.get("tokens"))
        out += [("t", "It costs "), ("b", f"{100 * (1 - t1 / t0):.1f}%"),
                ("t", f" of the uniform {diag.get('kv_dtype')} capacity ({fmt_num(int(t0))} → {fmt_num(int(t1))} tokens"
                      f", max concurrency {fmt_num(uniform.get('max_concurrency'))} → "
                      f"{fmt_num(mixed.get('max_concurrency'))}).")]
    return out


def _context(diag: dict) -> list[Run]:
    skip = diag.get("kv_dtype_skip_layers")
    out: list[Run] = [("t", f"{fmt_num(diag.get('num_layers'))} layers × {fmt_num(diag.get('num_kv_heads'))} kv heads × "
                            f"head dim {fmt_num(diag.get('head_dim'))}; scales {diag.get('kv_scales', '—')}, "
                            f"backend {diag.get('backend', '—')}")]
    if skip:
        out += [("t", "; layers already kept in bf16: "), ("c", str(skip))]
    out.append(("t", "."))
    return out


# ------------------------------------------------------------------------------ rendering

Part = Union[tuple, Table]


def _parts(diag: dict, plots: dict[str, Path], cell_line: Optional[str]) -> list[Part]:
    """("p", runs) paragraphs, ("img", name) figures, ("h", text) sub-headings, ("code", text) and Tables."""
    out: list[Part] = []
    if cell_line:
        out.append(("p", [("t", "Cell: "), ("c", cell_line)]))
    if diag.get("schema") not in (None, DIAGNOSTICS_SCHEMA):
        out.append(("p", [("t", f"Schema {diag.get('schema')!r}, expected {DIAGNOSTICS_SCHEMA!r}: read as far as "
                                "it matches.")]))
    out += [("p", _context(diag)), ("p", summary_text(diag))]
    out += [("img", n) for n in _FIG_ORDER if n in plots]
    out.append(top_layers_table(diag))
    out += [("h", "Skip-layer suggestion"), ("p", _suggestion_text(diag))]
    if "suggestion_steps" in plots:
        out.append(("img", "suggestion_steps"))
    if _cap_rows(diag)[0]:
        out.append(capacity_table(diag))
    confirm = diag.get("confirm") or {}
    if confirm.get("command"):
        cfg = f" (config {confirm['config']})" if confirm.get("config") else ""
        out += [("p", [("t", f"Confirm with a full evaluation{cfg}:")]), ("code", str(confirm["command"]))]
    return out


def _md_runs(runs: Iterable[Run]) -> str:
    fmt = {"t": "{}", "b": "**{}**", "c": "`{}`"}
    return "".join(fmt[s].format(t) for s, t in runs).strip()


def _html_runs(runs: Iterable[Run]) -> str:
    fmt = {"t": "{}", "b": "<b>{}</b>", "c": "<code>{}</code>"}
    return "".join(fmt[s].format(html.escape(t)) for s, t in runs).strip()


def _ensure_plots(diag: dict, plots_dir, plots, prefix: str) -> dict[str, Path]:
    if plots is not None:
        return plots
    if plots_dir is None:
        raise ValueError("render needs plots_dir (where to write the figures) or plots (already written)")
    return write_diagnostics_plots(diag, plots_dir, prefix)


def render_markdown(diag: dict, plots_dir: Optional[Path | str] = None, rel: str = "", *,
                    plots: Optional[dict[str, Path]] = None, level: int = 2, prefix: str = "",
                    cell_line: Optional[str] = None) -> str:
    """The section as Markdown.  Figures: ``plots`` ({name: path}, already written) or written now into
    ``plots_dir`` as ``<prefix><name>.png``; linked as ``<rel>/<file name>`` (``rel`` the folder of the PNGs
    relative to the Markdown file, "" when they sit next to it).  ``level``: heading level of the title."""
    plots = _ensure_plots(diag, plots_dir, plots, prefix)
    base = (rel.rstrip("/") + "/") if rel else ""
    out = ["#" * level + " " + section_title(diag), ""]
    for part in _parts(diag, plots, cell_line):
        if isinstance(part, Table):
            out.append(part.to_markdown())
        elif part[0] == "p":
            out += [_md_runs(part[1]), ""]
        elif part[0] == "h":
            out += ["#" * (level + 1) + " " + part[1], ""]
        elif part[0] == "img":
            out += [f"![{part[1]}]({base}{plots[part[1]].name})", ""]
        elif part[0] == "code":
            out += ["```", part[1], "```", ""]
    return "\n".join(out).rstrip() + "\n"


def render_html(diag: dict, plots_dir: Optional[Path | str] = None, *, plots: Optional[dict[str, Path]] = None,
                level: int = 2, prefix: str = "", cell_line: Optional[str] = None) -> str:
    """The section as an HTML fragment with the figures inlined (``data:image/png``).  Figures as for
    ``render_markdown``; with neither ``plots`` nor ``plots_dir`` they are drawn in a temporary folder."""
    if plots is None and plots_dir is None:
        with tempfile.TemporaryDirectory(prefix="kvbench-diag-") as tmp:
            return render_html(diag, tmp, level=level, prefix=prefix, cell_line=cell_line)
    plots = _ensure_plots(diag, plots_dir, plots, prefix)
    h, sub = min(level, 6), min(level + 1, 6)
    out = [f"<section class='diagnostics'><h{h}>{html.escape(section_title(diag))}</h{h}>"]
    for part in _parts(diag, plots, cell_line):
        if isinstance(part, Table):
            out.append(part.to_html())
        elif part[0] == "p":
            out.append(f"<p>{_html_runs(part[1])}</p>")
        elif part[0] == "h":
            out.append(f"<h{sub}>{html.escape(part[1])}</h{sub}>")
        elif part[0] == "img":
            out.append(_img(plots[part[1]], part[1]))
        elif part[0] == "code":
            out.append(f"<pre><code>{html.escape(part[1])}</code></pre>")
    out.append("</section>")
    return "\n".join(out) + "\n"


_DIAG_CSS = "pre{background:#f6f8fa;padding:.6em .8em;border-radius:4px;overflow-x:auto}pre code{padding:0}"


def write_report(diag: dict, out_dir: Path | str) -> dict[str, Path]:
    """Write the PNGs, report.md and report.html (self-contained) of one diagnostics file into ``out_dir``;
    returns {"markdown": path, "html": path, <figure name>: path}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = write_diagnostics_plots(diag, out_dir)
    md, page = out_dir / "report.md", out_dir / "report.html"
    atomic_write_text(md, render_markdown(diag, plots=plots, level=1))
    title = html.escape(section_title(diag))
    atomic_write_text(page, "\n".join([
        "<!DOCTYPE html>", "<html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>{title}</title><style>{_CSS}{_DIAG_CSS}</style></head><body>",
        render_html(diag, plots=plots, level=1), "</body></html>"]) + "\n")
    return {"markdown": md, "html": page, **plots}


def sweep_sections(cells, out_dir: Path | str) -> tuple[str, str, dict[str, Path]]:
    """(Markdown, HTML fragment, {name: path}) of the diagnostics sections of every cell holding one
    (``CellData.diagnostics``), figures written into ``out_dir`` as ``diag<n>_<name>.png``; empty strings and
    {} when no cell has diagnostics."""
    md, page, written = [], [], {}
    diags = [c for c in cells if isinstance(getattr(c, "diagnostics", None), dict)]
    if diags:
        page.append(f"<style>{_DIAG_CSS}</style>")
    for n, cell in enumerate(diags, 1):
        prefix = f"diag{n}_"
        try:
            plots = write_diagnostics_plots(cell.diagnostics, out_dir, prefix)
            line = f"{cell.short or cell.label} [{cell.key}]"
            md.append(render_markdown(cell.diagnostics, plots=plots, level=2, cell_line=line))
            page.append(render_html(cell.diagnostics, plots=plots, level=2, cell_line=line))
        except (KeyError, TypeError, ValueError, IndexError) as e:  # a malformed file costs its section only
            log.warning("diagnostics of cell %s not shown: %s", cell.key, e)
            msg = f"Diagnostics of cell {cell.key} could not be shown: {type(e).__name__}: {e}"
            md.append(f"## Where the error comes from: cell {cell.key}\n\n{msg}\n")
            page.append(f"<h2>Where the error comes from: cell {html.escape(cell.key)}</h2><p>{html.escape(msg)}</p>")
            continue
        written.update({f"{prefix}{k}": v for k, v in plots.items()})
    return "\n".join(md), "\n".join(page) if diags else "", written
