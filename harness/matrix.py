"""Sweep config → cells.

A cell is one point of the matrix (model, target, prefill_backend, decode_backend, kv_dtype, kv_scales,
concurrency; plus ``options``, ``scales_file`` and ``extra_args`` when its entries set them); its key is
``store.canonical_key`` of that canonical config, so the same cell gets the same directory in every run.
Cells come out grouped: all concurrency levels of one (model, target, backends, kv format) are consecutive,
so the engine or server is started once per group.  Each target runs its own (backend, KV) entries
(``sweep_axes.entries``: the product of the axes, a target's own backends, or ``axes.combos``).

The accuracy suites run in the cell at ``accuracy_concurrency``.  When that level is not on the load axis,
each group gets one more cell at it, first in the group, that runs the suites only (``run_load`` false).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvbench.core import KVConfig, is_kv_option, kv_option_names
from kvbench.core import matches, parse_selector
from kvbench.core import canonical_key
from kvbench.harness.sweep.axes import cell_fields, entries
from kvbench.harness.sweep.config import CELL_KEYS, DEFAULT_MODEL, SweepConfig, SweepConfigError


@dataclass(frozen=True)
class Cell:
    key: str
    label: str
    config: dict  # CELL_KEYS (+ "options", "scales_file", "extra_args" when its entries set them)
    index: int  # position in the full matrix (stable across --only filters)
    run_accuracy: bool  # concurrency == the sweep's accuracy_concurrency
    run_load: bool = True  # False: an accuracy-only cell (accuracy_concurrency off the load axis; the A/A control)

    @property
    def group(self) -> tuple:
        """Cells with the same group share one engine / server launch."""
        c = self.config
        return (c["model"], c["target"], c["prefill_backend"], c["decode_backend"], c["kv_dtype"], c["kv_scales"],
                tuple(sorted(c.get("options", {}).items())), c.get("scales_file"), c.get("extra_args"),
                bool(c.get("aa_control")))  # an A/A control never shares its original's engine

    @property
    def concurrency(self) -> int:
        return int(self.config["concurrency"])

    @property
    def kv(self) -> KVConfig:
        """The cell's KV configuration (format, scales, options, backends)."""
        return KVConfig.from_cell(self.config)

    @property
    def kv_label(self) -> str:
        return self.kv.label()


def cell_config(model: str, target: str, prefill: str, decode: str, kv_dtype: str, kv_scales: str,
                concurrency: int, options: Optional[dict] = None, scales_file: Optional[str] = None,
                extra_args: Optional[str] = None) -> dict:
    cfg = {
        "model": model, "target": target, "prefill_backend": prefill, "decode_backend": decode,
        "kv_dtype": kv_dtype, "kv_scales": kv_scales, "concurrency": int(concurrency),
    }
    if options:
        cfg["options"] = dict(sorted(options.items()))
    if scales_file:
        cfg["scales_file"] = scales_file
    if extra_args:
        cfg["extra_args"] = extra_args
    return cfg


def _kv_label(cfg: dict) -> str:
    """``fp8_e4m3/checkpoint@scales.json+quantize_query=decode skip 0,1,31`` (``KVConfig.label``)."""
    return KVConfig.from_cell(cfg).label()


def _label(cfg: dict, show_model: bool, show_target: bool) -> str:
    be = cfg["prefill_backend"] if cfg["prefill_backend"] == cfg["decode_backend"] else f"{cfg['prefill_backend']}+{cfg['decode_backend']}"
    parts = [_kv_label(cfg), be, f"c={cfg['concurrency']}"]
    if cfg.get("extra_args"):
        parts.insert(2, f"[{cfg['extra_args']}]")
    if show_target:
        parts.insert(0, cfg["target"])
    if show_model:
        parts.insert(0, cfg["model"])
    return " ".join(parts)


def expand(sweep: SweepConfig) -> list[Cell]:
    """Every cell of the matrix, grouped by engine launch, in a stable order."""
    cells: list[Cell] = []
    show_model, show_target = len(sweep.models) > 1, len(sweep.targets) > 1
    acc = sweep.accuracy_concurrency
    acc_only = acc not in sweep.concurrency and bool(sweep.suites)  # an accuracy-only cell per group

    def add(cfg: dict, run_accuracy: bool, run_load: bool = True) -> None:
        cells.append(Cell(key=canonical_key(cfg), label=_label(cfg, show_model, show_target), config=cfg,
                          index=len(cells), run_accuracy=run_accuracy, run_load=run_load))

    for model in sweep.models:
        for ti, target in enumerate(sweep.targets):
            for e in entries(sweep, target, ti):
                f = cell_fields(e.backends, e.kv)
                if acc_only:
                    add(_entry_config(model, target.name, f, acc), True, run_load=False)
                for conc in sweep.concurrency:
                    add(_entry_config(model, target.name, f, conc), conc == acc)
    if sweep.aa_control:
        cells.extend(_aa_control_cells(sweep, cells))
    return cells


def _entry_config(model: str, target: str, f: dict, conc: int) -> dict:
    return cell_config(model, target, f["prefill_backend"], f["decode_backend"], f["kv_dtype"], f["kv_scales"], conc,
                       f.get("options"), f.get("scales_file"), f.get("extra_args"))


def aa_concurrency(sweep: SweepConfig) -> int:
    """The A/A control's concurrency: ``aa_concurrency``, else half the accuracy concurrency (2 when that is
    1), so the control's requests are batched differently from the baseline's."""
    if sweep.aa_concurrency is not None:
        return sweep.aa_concurrency
    acc = sweep.accuracy_concurrency
    return acc // 2 if acc > 1 else 2


def _aa_control_cells(sweep: SweepConfig, cells: list[Cell]) -> list[Cell]:
    """The A/A controls: the baseline's accuracy cell once more (and, with ``aa_control: all`` or a list of
    selectors, those accuracy cells too), each with ``aa_control: true`` in its config (so its own key).

    They run last, each in a fresh engine, at a different concurrency (``aa_concurrency``), so the paired
    comparison of a cell with its control measures the stack's nondeterminism for that configuration
    (batching, scheduling, float reductions; a quantized cache can turn a last-bit difference into a
    different token) — the floor under any delta (reports/gate/discriminative.py)."""
    acc = [c for c in cells if c.run_accuracy]
    if not acc or not sweep.suites:
        return []
    base = [c for c in acc if matches(c.config, sweep.baseline)] if sweep.baseline else acc
    if not base:
        raise SweepConfigError(f"aa_control: no accuracy cell matches the baseline {sweep.baseline}")
    chosen = [base[0]] + [c for c in acc if c is not base[0] and _wants_control(sweep.aa_control, c)]
    conc = aa_concurrency(sweep)
    out = []
    for b in chosen:
        cfg = {**b.config, "aa_control": True, "concurrency": conc}
        label = b.label.replace(f"c={b.config['concurrency']}", f"c={conc}") + " A/A"
        out.append(Cell(key=canonical_key(cfg), label=label, config=cfg, index=len(cells) + len(out), run_accuracy=True,
                        run_load=False))
    return out


def _wants_control(aa, cell: Cell) -> bool:
    """Whether ``aa_control`` (True: the baseline only; "all"; or a list of selectors) asks for ``cell``."""
    if aa == "all":
        return True
    if isinstance(aa, list):
        return any(matches(cell.config, parse_selector(s)) for s in aa)
    return False


def select(cells: list[Cell], selector: Optional[str]) -> list[Cell]:
    """Cells matching ``key=value[,key=value]`` (``--only``); clear errors for unknown keys / no match."""
    if not selector:
        return list(cells)
    try:
        sel = parse_selector(selector)
    except ValueError as e:
        raise SweepConfigError(f"--only: {e}") from None
    for k in sel:
        if k not in CELL_KEYS and not is_kv_option(k):
            raise SweepConfigError(f"--only: unknown cell key {k!r}; allowed keys: {', '.join((*CELL_KEYS, *kv_option_names()))}")
    out = [c for c in cells if matches(c.config, sel)]
    if not out:
        seen = {k: sorted({str(c.config[k]) for c in cells}) for k in sel}
        raise SweepConfigError(f"--only {selector!r} matches no cell; values in this sweep: {seen}")
    return out


def groups(cells: list[Cell]) -> list[list[Cell]]:
    """Consecutive runs of cells that share an engine launch."""
    out: list[list[Cell]] = []
    for c in cells:
        if out and out[-1][0].group == c.group:
            out[-1].append(c)
        else:
            out.append([c])
    return out


def engine_options(sweep: SweepConfig, cell: Cell) -> dict:
    """EngineConfig keyword arguments of an embedded cell (sweep engine options, the target's overrides,
    then the cell's own axes)."""
    c = cell.config
    target = sweep.target(c["target"])
    opts = {**sweep.engine, **target.engine}
    kv = cell.kv
    opts.update(model=None if c["model"] == DEFAULT_MODEL else c["model"], kv_dtype=kv.dtype, kv_scales=kv.scales,
                prefill_backend=kv.prefill_backend, decode_backend=kv.decode_backend, **dict(kv.options))
    return opts
