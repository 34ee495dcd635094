"""Figures of a KV error diagnostics file (``diagnostics.json``, schema ``kvbench:diagnostics:v1``): where the
quantization error of the KV cache sits, by layer × KV head, and which layers the output distribution feels.

* ``kv_error``: relative error of K and of V per (layer, kv head), two panels on one colour scale;
* ``attn_error``: relative error of the attention output per (layer, kv head);
* ``saturation`` / ``flushed``: share of K and V values clipped at the format's largest value / flushed to
  zero, only when some value was;
* ``kl_contribution``: leave-one-out KL contribution per layer (full candidate minus that layer in bf16;
  negative values drawn below zero), the suggested skip layers highlighted;
* ``suggestion_steps``: KL against the number of layers kept in bf16, with the limit.

Layers kept in a format other than the cache's ``kv_dtype`` get a grey label with their format and a hatched
row.  Same conventions as ``reports.plots`` (Agg canvas, atomic PNG writes); each figure function returns
False, writing nothing, when the file has no data for it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import numpy as np

from kvbench.core import parse_layer_set
from kvbench.reports.render.plots import _COLORS, _figure, _save

__all__ = ["DIAGNOSTICS_SCHEMA", "PLOT_NAMES", "layer_rows", "heads_matrix", "layer_mean", "skip_layer_indices",
           "kl_contributions", "kv_error_plot", "attn_error_plot", "fraction_plot", "kl_contribution_plot",
           "suggestion_steps_plot", "write_diagnostics_plots"]

DIAGNOSTICS_SCHEMA = "kvbench:diagnostics:v1"
# every figure name, in the order a report shows them
PLOT_NAMES = ("kl_contribution", "suggestion_steps", "kv_error", "attn_error", "saturation", "flushed")
_SKIP_COLOR = "#d62728"
_BAR_COLOR = _COLORS[0]
_OTHER_FORMAT = "#8c8c8c"


# ------------------------------------------------------------------------------ data helpers


def layer_rows(diag: dict) -> list[dict]:
    """The per-layer entries, ordered by layer index."""
    return sorted(diag.get("layers") or [], key=lambda r: int(r.get("layer", 0)))


def _num(v) -> float:
    try:
        return float(v) if v is not None else math.nan
    except (TypeError, ValueError):
        return math.nan


def heads_matrix(diag: dict, part: str, key: str) -> np.ndarray:
    """layers × kv heads array of ``layers[i][part][key]`` (``part`` "k" or "v"), or of ``attn_rel_err`` when
    ``part`` is "attn"; missing values are NaN."""
    rows = layer_rows(diag)
    heads = max([int(diag.get("num_kv_heads") or 0)] + [len(_values(r, part, key)) for r in rows] + [1])
    out = np.full((len(rows), heads), np.nan)
    for i, r in enumerate(rows):
        vals = _values(r, part, key)
        out[i, : len(vals)] = [_num(v) for v in vals]
    return out


def _values(row: dict, part: str, key: str) -> list:
    if part == "attn":
        return list(row.get("attn_rel_err") or [])
    return list((row.get(part) or {}).get(key) or [])


def layer_mean(row: dict, part: str, key: str = "rel_err") -> float:
    """Mean over kv heads of one layer's value (NaN when it has none)."""
    vals = [_num(v) for v in _values(row, part, key)]
    vals = [v for v in vals if not math.isnan(v)]
    return sum(vals) / len(vals) if vals else math.nan


def _layer_format(diag: dict, row: dict) -> str:
    fmt = row.get("format")
    if fmt is None:
        fmts = diag.get("layer_dtypes") or []
        i = int(row.get("layer", 0))
        fmt = fmts[i] if i < len(fmts) else diag.get("kv_dtype")
    return str(fmt)


def _layer_labels(diag: dict) -> tuple[list[str], list[bool]]:
    """Tick labels ("3", or "3 · bf16" for a layer in another format than kv_dtype) and which ones differ."""
    kv = str(diag.get("kv_dtype"))
    labels, other = [], []
    for r in layer_rows(diag):
        fmt = _layer_format(diag, r)
        labels.append(str(r.get("layer")) + ("" if fmt == kv else f" · {fmt}"))
        other.append(fmt != kv)
    return labels, other


def skip_layer_indices(diag: dict, skip: Optional[str] = "suggestion") -> list[int]:
    """Layer indices of a skip set (default: the suggestion's ``skip_layers``), patterns resolved against the
    layers' ``sliding_window``; indices outside the model are dropped."""
    if skip == "suggestion":
        skip = (diag.get("suggestion") or {}).get("skip_layers")
    if not skip:
        return []
    idx, pats = parse_layer_set(skip)
    rows = layer_rows(diag)
    present = {int(r.get("layer", -1)) for r in rows}
    out = {i for i in idx if i in present}
    for r in rows:
        swa = r.get("sliding_window") is not None
        if ("sliding_window" in pats and swa) or ("full_attention" in pats and not swa):
            out.add(int(r["layer"]))
    return sorted(out)


def kl_contributions(diag: dict) -> list[tuple[int, float]]:
    """[(layer, kl_contribution)] for the layers that have one."""
    return [(int(r["layer"]), _num(r.get("kl_contribution"))) for r in layer_rows(diag)
            if not math.isnan(_num(r.get("kl_contribution")))]


# ------------------------------------------------------------------------------ heatmaps


def _heat_size(n_layers: int, n_heads: int, panels: int) -> tuple[float, float]:
    per_layer = 0.26 if n_layers <= 40 else 0.17
    w = panels * max(2.6, 0.55 * n_heads + 1.4) + 1.6
    h = max(3.2, per_layer * n_layers + 1.7)
    return max(w, 5.2), h


def _fmt_cell(v: float, pct: bool) -> str:
    if pct:
        return f"{100 * v:.2g}%"
    return f"{v:.2g}" if v >= 0.01 or v == 0 else f"{v:.1e}"


def _heat_panel(ax, diag: dict, data: np.ndarray, norm, cmap, title: str, pct: bool):
    from matplotlib.patches import Rectangle

    n_layers, n_heads = data.shape
    im = ax.imshow(np.ma.masked_invalid(data), cmap=cmap, norm=norm, aspect="auto", origin="upper",
                   interpolation="nearest")
    labels, other = _layer_labels(diag)
    fs = 8 if n_layers <= 40 else 6
    ax.set_yticks(range(n_layers), labels, fontsize=fs)
    for tick, grey in zip(ax.get_yticklabels(), other):
        if grey:
            tick.set_color(_OTHER_FORMAT)
            tick.set_fontstyle("italic")
    for i, grey in enumerate(other):
        if grey:  # the layer is not in the candidate format: hatched so its (small) error is not misread
            ax.add_patch(Rectangle((-0.5, i - 0.5), n_heads, 1, fill=False, hatch="///", edgecolor=_OTHER_FORMAT,
                                   lw=0))
    ax.set_xticks(range(n_heads), [str(h) for h in range(n_heads)], fontsize=8)
    ax.set_xlabel("kv head")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=10)
    if n_layers * n_heads <= 128:
        cmap_obj = im.get_cmap()
        for i in range(n_layers):
            for j in range(n_heads):
                v = data[i, j]
                if math.isnan(v) or (pct and v == 0):  # shares: only the nonzero ones written
                    continue
                r, g, b, _ = cmap_obj(norm(v))
                dark = 0.299 * r + 0.587 * g + 0.114 * b < 0.5
                ax.text(j, i, _fmt_cell(v, pct), ha="center", va="center", fontsize=7 if n_heads <= 8 else 6,
                        color="white" if dark else "black")
    return im


def _norm(arrays: list[np.ndarray]):
    from matplotlib.colors import Normalize

    vals = np.concatenate([a[np.isfinite(a)].ravel() for a in arrays]) if arrays else np.array([])
    top = float(vals.max()) if vals.size else 1.0
    return Normalize(vmin=0.0, vmax=top if top > 0 else 1.0)


def _mean_text(diag: dict, data: np.ndarray) -> str:
    """"mean x" over the layers in the cache's format (all layers when none or every one is)."""
    _, other = _layer_labels(diag)
    rows = [i for i, o in enumerate(other) if not o]
    sub = data[rows] if rows and len(rows) < data.shape[0] else data
    if not np.isfinite(sub).any():
        return "no data"
    where = f"\nover {diag.get('kv_dtype')} layers" if sub is not data else ""
    return f"mean {float(np.nanmean(sub)):.3g}{where}"


def _title_suffix(diag: dict) -> str:
    return f"{short_model(diag.get('model', ''))} {diag.get('kv_dtype', '')}".strip()


def short_model(name: str, width: int = 40) -> str:
    """A model name short enough for a plot title: a path's last part, long names cut with an ellipsis."""
    name = str(name or "").rstrip("/")
    if "/" in name and not name.startswith("synthetic:"):
        name = name.rsplit("/", 1)[-1]
    return name if len(name) <= width else name[: width - 1] + "…"


def kv_error_plot(diag: dict, path: Path) -> bool:
    """Relative error of K and V per (layer, kv head), one colour scale for both, values annotated."""
    k, v = heads_matrix(diag, "k", "rel_err"), heads_matrix(diag, "v", "rel_err")
    if not layer_rows(diag) or not (np.isfinite(k).any() or np.isfinite(v).any()):
        return False
    fig = _figure(*_heat_size(k.shape[0], k.shape[1], 2))
    axes = fig.subplots(1, 2, sharey=True)
    norm = _norm([k, v])
    im = None
    for ax, data, name in zip(axes, (k, v), ("K", "V")):
        im = _heat_panel(ax, diag, data, norm, "YlOrRd", f"{name} relative error\n{_mean_text(diag, data)}", pct=False)
    axes[1].set_ylabel("")
    cb = fig.colorbar(im, ax=list(axes), shrink=0.9)
    cb.set_label("‖x̂ − x‖ / ‖x‖ per kv head")
    fig.suptitle(f"KV quantization error by layer × head: {_title_suffix(diag)}", fontsize=11)
    return _save(fig, path)


def attn_error_plot(diag: dict, path: Path) -> bool:
    """Relative error of the attention output per (layer, kv head) (over the query heads a kv head serves)."""
    a = heads_matrix(diag, "attn", "")
    if not layer_rows(diag) or not np.isfinite(a).any():
        return False
    w, h = _heat_size(a.shape[0], a.shape[1], 1)
    fig = _figure(w, h)
    ax = fig.subplots()
    norm = _norm([a])
    im = _heat_panel(ax, diag, a, norm, "PuRd", f"relative error per kv head\n{_mean_text(diag, a)}", pct=False)
    cb = fig.colorbar(im, ax=ax, shrink=0.9)
    cb.set_label("‖out_cand − out_ref‖ / ‖out_ref‖")
    fig.suptitle(f"Attention output error: {_title_suffix(diag)}", fontsize=11)
    return _save(fig, path)


def fraction_plot(diag: dict, key: str, path: Path) -> bool:
    """Share of K and V values ``saturated`` (clipped at the format's largest value) or ``flushed`` (to zero)
    per (layer, kv head); False when every share is zero or missing."""
    k, v = heads_matrix(diag, "k", key), heads_matrix(diag, "v", key)
    if not layer_rows(diag) or not (np.nan_to_num(k) > 0).any() and not (np.nan_to_num(v) > 0).any():
        return False
    fig = _figure(*_heat_size(k.shape[0], k.shape[1], 2))
    axes = fig.subplots(1, 2, sharey=True)
    norm = _norm([k, v])
    what = "saturated" if key == "saturated" else "flushed to zero"
    im = None
    for ax, data, name in zip(axes, (k, v), ("K", "V")):
        title = f"{name} values {'clipped at the format max' if key == 'saturated' else 'flushed to zero'}"
        im = _heat_panel(ax, diag, data, norm, "Blues" if key == "flushed" else "Oranges", title, pct=True)
    axes[1].set_ylabel("")
    cb = fig.colorbar(im, ax=list(axes), shrink=0.9)
    cb.formatter = _pct_formatter()
    cb.update_ticks()
    cb.set_label(f"share of values {what}")
    fig.suptitle(f"{key.capitalize()} values by layer × head: {_title_suffix(diag)}", fontsize=11)
    return _save(fig, path)


def _pct_formatter():
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda x, _pos: f"{100 * x:.2g}%")


# ------------------------------------------------------------------------------ KL


def kl_contribution_plot(diag: dict, path: Path) -> bool:
    """Bars of each layer's leave-one-out KL contribution (negative ones below zero), suggested skip layers in
    red, n/a for layers without one; False when no layer has a contribution."""
    from matplotlib.patches import Patch

    rows = layer_rows(diag)
    contrib = [_num(r.get("kl_contribution")) for r in rows]
    if not rows or all(math.isnan(c) for c in contrib):
        return False
    skip = set(skip_layer_indices(diag))
    layers = [int(r["layer"]) for r in rows]
    _, other = _layer_labels(diag)
    colors = [_SKIP_COLOR if l in skip else (_OTHER_FORMAT if o else _BAR_COLOR) for l, o in zip(layers, other)]
    n = len(rows)
    fig = _figure(min(16.0, max(6.5, 0.32 * n + 2.5)), 4.5)
    ax = fig.subplots()
    xs = list(range(n))
    ax.bar(xs, [0.0 if math.isnan(c) else c for c in contrib], color=colors, width=0.75)
    ax.axhline(0, color="#222222", lw=0.8)
    top = max([abs(c) for c in contrib if not math.isnan(c)] + [1e-12])
    for x, c in zip(xs, contrib):
        if math.isnan(c):
            ax.annotate("n/a", (x, 0), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=7,
                        color="#57606a", rotation=90 if n > 24 else 0)
    full = _num((diag.get("kl") or {}).get("full"))
    if n <= 24 and not math.isnan(full) and full > 0:  # share of the full KL on the largest bars
        for x, c in sorted(zip(xs, contrib), key=lambda t: -abs(t[1]) if not math.isnan(t[1]) else 0)[:3]:
            if not math.isnan(c) and c != 0:
                ax.annotate(f"{100 * c / full:.0f}%", (x, c), textcoords="offset points",
                            xytext=(0, 3 if c > 0 else -3), ha="center", va="bottom" if c > 0 else "top", fontsize=8)
    step = 1 if n <= 40 else math.ceil(n / 40)
    ax.set_xticks(xs[::step], [str(l) for l in layers[::step]], fontsize=8 if n <= 40 else 7)
    for tick, o in zip(ax.get_xticklabels(), other[::step]):
        if o:
            tick.set_color(_OTHER_FORMAT)
    ax.set_xlim(-0.7, n - 0.3)
    lo, hi = ax.get_ylim()
    ax.set_ylim(min(lo, -0.05 * top), max(hi, 0) + 0.08 * top)
    ax.set_xlabel("layer")
    ax.set_ylabel("KL(full) − KL(layer in bf16), nats/token")
    ax.grid(axis="y", alpha=0.3)
    handles = [Patch(color=_BAR_COLOR, label=f"layer in {diag.get('kv_dtype')}")]
    if skip:
        sug = diag.get("suggestion") or {}
        handles.append(Patch(color=_SKIP_COLOR, label=f"suggested skip ({sug.get('skip_layers')})"))
    if any(other):
        handles.append(Patch(color=_OTHER_FORMAT, label="layer already in another format"))
    fig.legend(handles=handles, fontsize=8, loc="outside lower center", ncols=len(handles), frameon=False)
    full_txt = "" if math.isnan(full) else f" (full KL {full:.3g})"
    ax.set_title(f"KL contribution by layer, leave-one-out{full_txt}: {_title_suffix(diag)}", fontsize=10)
    return _save(fig, path)


def suggestion_steps_plot(diag: dict, path: Path) -> bool:
    """KL against the number of layers kept in bf16, along the suggestion's greedy steps, with the limit."""
    sug = diag.get("suggestion") or {}
    steps = [s for s in sug.get("steps") or [] if not math.isnan(_num(s.get("kl")))]
    if not steps:
        return False
    steps.sort(key=lambda s: int(s.get("n_skipped") or 0))
    xs = [int(s.get("n_skipped") or 0) for s in steps]
    ys = [_num(s.get("kl")) for s in steps]
    limit = _num(sug.get("limit"))
    fig = _figure(6.4, 3.8)
    ax = fig.subplots()
    ax.plot(xs, ys, "o-", color=_BAR_COLOR, lw=1.6, label="KL with these layers in bf16")
    if not math.isnan(limit):
        ax.axhline(limit, color=_SKIP_COLOR, ls="--", lw=1.1, label=f"limit {limit:.3g}")
    chosen = [(x, y) for x, y, s in zip(xs, ys, steps) if s.get("skip_layers") == sug.get("skip_layers")]
    if chosen:
        ax.scatter([chosen[0][0]], [chosen[0][1]], s=160, facecolors="none", edgecolors="#111111", linewidths=1.4,
                   zorder=4, label="suggested")
    if len(steps) <= 10:
        for x, y, s in zip(xs, ys, steps):
            ax.annotate(s.get("skip_layers") or "none", (x, y), textcoords="offset points", xytext=(5, 5), fontsize=7,
                        color="#333333")
    pos = [y for y in ys + ([limit] if not math.isnan(limit) else []) if y > 0]
    if len(pos) == len(ys) + (0 if math.isnan(limit) else 1) and max(pos) / min(pos) > 30:
        ax.set_yscale("log")
    else:
        ax.set_ylim(0, max(ys + ([limit] if not math.isnan(limit) else [])) * 1.15 or 1.0)
    ax.set_xticks(sorted(set(xs)))
    ax.margins(x=0.12)
    ax.set_xlabel("layers kept in bf16")
    ax.set_ylabel("KL, nats/token")
    ax.set_title("Suggested skip set: KL as layers are kept in bf16", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


# ------------------------------------------------------------------------------ all figures


def write_diagnostics_plots(diag: dict, out_dir: Path | str, prefix: str = "") -> dict[str, Path]:
    """Write every figure that has data as ``out_dir/<prefix><name>.png``; returns {name: path} with names from
    ``PLOT_NAMES``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fns = {"kl_contribution": kl_contribution_plot, "suggestion_steps": suggestion_steps_plot,
           "kv_error": kv_error_plot, "attn_error": attn_error_plot,
           "saturation": lambda d, p: fraction_plot(d, "saturated", p),
           "flushed": lambda d, p: fraction_plot(d, "flushed", p)}
    out: dict[str, Path] = {}
    for name in PLOT_NAMES:
        p = out_dir / f"{prefix}{name}.png"
        if fns[name](diag, p):
            out[name] = p
    return out
