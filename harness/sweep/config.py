"""Sweep configuration: the YAML schema of ``configs/*.yaml`` and its validation.

A sweep is the matrix model × target × backend pair × KV format (with scale policy) × concurrency (or
explicit backend/KV combinations: ``axes.combos``), plus what each cell runs (accuracy suites, the fidelity
suite, a load test), the baseline cell and the gate thresholds.  Every unknown key and bad value is reported
with its path in the file and the allowed choices; so is a cell option that cannot reach its target (a
server's launch template that does not carry it: harness/launch/options.py, harness/sweep/axes.py).  No torch
here: ``kvbench sweep --help`` imports this module.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from kvbench.harness.cell_diagnostics import parse_diagnostics
from kvbench.harness.config_checks import (SweepConfigError, _bool, _check_keys, _choice, _fail, _int, _list,
                                           _mapping, _num, _str)
from kvbench.harness.launch.options import parse_target_options
from kvbench.core import kv_option, kv_option_names, list_valued_options
from kvbench.core import parse_selector
from kvbench.harness.sweep.axes import (BackendPair, check_targets, entries, kv_ident, parse_backend_entry,
                                        parse_combos, parse_kv_entry)
from kvbench.harness.sweep.specs import (CELL_KEYS, DEFAULT_MODEL, SLO_KEYS, GateSpec, KVSpec,
                                         LoadSpec, SuiteSpec, TargetSpec, _gate, _load, _suite, _target, _target_dict)

__all__ = ["SweepConfig", "SweepConfigError", "parse_config", "load_config", "CELL_KEYS", "DEFAULT_MODEL",
           "SuiteSpec", "TargetSpec"]


_ENV_REF = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def expand_env(text: str, path: str) -> str:
    """``${VAR}`` and ``${VAR:-default}`` in a config value (a model path that differs between machines);
    an unset variable without a default is a config error naming it."""
    def sub(m: re.Match) -> str:
        value = os.environ.get(m.group(1))
        if value:
            return value
        if m.group(2) is not None:
            return m.group(2)
        _fail(path, f"${{{m.group(1)}}} is not set (set it, or write ${{{m.group(1)}:-default}})")
    return _ENV_REF.sub(sub, text)


# ------------------------------------------------------------------------------ the config
@dataclass
class SweepConfig:
    name: str
    models: list[str]
    engine: dict
    targets: list[TargetSpec]
    backends: list[BackendPair]  # (prefill, decode) tuples; with combos: the entries the combos use
    kv: list[KVSpec]  # with combos: the entries the combos use
    concurrency: list[int]
    accuracy_concurrency: int
    suites: list[SuiteSpec]
    load: LoadSpec
    slo: dict
    baseline: dict
    gate: GateSpec
    data_dir: Optional[str] = None
    description: str = ""
    seed: int = 0
    # a second copy of the baseline's accuracy cell, in a fresh engine at ``aa_concurrency`` (different
    # batching): the run's noise floor (reports/gate/discriminative.py); on by default when the sweep has suites.
    # "all" (or a list of cell selectors) reruns those accuracy cells too: each candidate's own noise floor
    aa_control: Any = True
    aa_concurrency: Optional[int] = None  # None: half the accuracy concurrency (2 when that is 1)
    source: Optional[str] = None  # the file it came from (not part of to_dict)
    combos: Optional[list] = None  # axes.combos: [(BackendPair, KVSpec)] run instead of backends x kv
    implicit_axes: tuple = ()  # "backends" / "kv" when the config gives none (targets run their defaults)
    # per-layer diagnostics in quantized embedded accuracy cells (harness/cell_diagnostics.py); None = off
    diagnostics: Optional[Any] = None

    def to_dict(self) -> dict:
        """Plain, JSON-safe form (recorded in the manifest; compared on --resume).  Keys added to the schema
        later are left out while they hold their defaults, so the manifests of earlier runs still compare
        equal on --resume."""
        d = asdict(self)
        for k in ("source", "implicit_axes", "combos"):
            d.pop(k)
        if d.get("diagnostics") is None:  # added later: absent while off, so earlier manifests compare equal
            d.pop("diagnostics", None)
        d["backends"] = [p.to_json() if isinstance(p, BackendPair) else list(p) for p in self.backends]
        d["kv"] = [_kv_dict(k) for k in self.kv]
        if self.combos:
            d["combos"] = [{"backends": b.to_json(), "kv": _kv_dict(k)} for b, k in self.combos]
        d["targets"] = [_target_dict(t) for t in self.targets]
        d["load"]["request_rate"] = "inf" if math.isinf(self.load.request_rate) else self.load.request_rate
        return d

    def target(self, name: str) -> TargetSpec:
        for t in self.targets:
            if t.name == name:
                return t
        raise KeyError(name)


_TOP_KEYS = (
    "name", "description", "model", "engine", "targets", "axes", "accuracy_concurrency", "suites", "load",
    "slo", "baseline", "gate", "data_dir", "seed", "aa_control", "aa_concurrency", "diagnostics",
)
_AXES_KEYS = ("backends", "kv", "concurrency", "combos")
# engine options the sweep controls per cell (set through the axes, not through `engine:`)
_AXIS_ENGINE_KEYS = ("model", "kv_dtype", "kv_scales", "prefill_backend", "decode_backend")  # + the KV options


def _selector_value(key: str, value: Any, path: str) -> str:
    """A ``baseline`` value as a selector compares it: layer sets canonical (``[31, 0]`` -> ``0,31``; empty /
    ``none`` = the cells without the option), booleans lower case, the rest as text."""
    if key in list_valued_options():
        if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")) or value == []:
            return "none"
        try:
            return kv_option(key).parse(value) or "none"
        except ValueError as e:
            _fail(path, str(e))
    return str(value).lower() if isinstance(value, bool) else str(value)


def _engine_keys() -> tuple[str, ...]:
    from dataclasses import fields

    from kvbench.runtime import EngineConfig

    return tuple(f.name for f in fields(EngineConfig) if f.name not in _AXIS_ENGINE_KEYS and f.name not in kv_option_names())


def _aa_control(v: Any) -> Any:
    """``aa_control``: true / false (the baseline's control), "all" (every accuracy cell's), or a list of cell
    selectors ("kv_dtype=nvfp4") whose accuracy cells get a control besides the baseline's."""
    if v == "all" or isinstance(v, bool):
        return v
    if isinstance(v, list) and v and all(isinstance(x, str) for x in v):
        for i, sel in enumerate(v):
            try:
                parse_selector(sel)
            except ValueError as e:
                raise SweepConfigError(f"aa_control[{i}]: {e}") from None
        return list(v)
    raise SweepConfigError(f"aa_control: expected true, false, \"all\" or a list of cell selectors such as "
                           f"[\"kv_dtype=nvfp4\"], got {v!r}")


def parse_config(raw: Any, source: Optional[str] = None) -> SweepConfig:
    """Validate a parsed YAML document and build the ``SweepConfig``."""
    if raw is None:  # yaml.safe_load of an empty (or comments-only) file
        _fail("config", "expected a mapping, got an empty file")
    raw = _mapping(raw, "config")
    _check_keys(raw, _TOP_KEYS, "config")
    engine_keys = _engine_keys()
    engine = dict(_mapping(raw.get("engine"), "engine"))
    _check_keys(engine, engine_keys, "engine")

    models = _models(raw)
    targets = _targets(raw, engine_keys)
    names = [t.name for t in targets]

    axes = _mapping(raw.get("axes"), "axes")
    _check_keys(axes, _AXES_KEYS, "axes")
    backends, kv, combos, implicit = _backend_kv_axes(axes, targets)
    conc = [_int(c, f"axes.concurrency[{i}]", 1) for i, c in enumerate(_list(axes.get("concurrency", [1]), "axes.concurrency"))]
    if len(set(conc)) != len(conc):
        _fail("axes.concurrency", "duplicate entries")

    suites, acc = _suites(raw, conc, targets)
    load = _load(raw.get("load"), "load")

    slo = dict(_mapping(raw.get("slo"), "slo"))
    _check_keys(slo, SLO_KEYS, "slo")
    slo = {k: _num(v, f"slo.{k}", 1e-9) for k, v in slo.items()}

    baseline = _baseline(raw, names)
    data_dir = raw.get("data_dir")
    if data_dir is not None:
        data_dir = _str(data_dir, "data_dir")  # relative paths are relative to the working directory
    cfg = SweepConfig(
        name=_name(raw.get("name", Path(source).stem if source else "sweep")),
        models=models,
        engine=engine,
        targets=targets,
        backends=backends,
        kv=kv,
        concurrency=conc,
        accuracy_concurrency=acc,
        suites=suites,
        load=load,
        slo=slo,
        baseline=baseline,
        gate=_gate(raw.get("gate"), "gate", suites),
        data_dir=data_dir,
        description=str(raw.get("description", "")),
        seed=_int(raw.get("seed", 0), "seed"),
        aa_control=_aa_control(raw.get("aa_control", bool(suites))),
        aa_concurrency=None if raw.get("aa_concurrency") is None else _int(raw["aa_concurrency"], "aa_concurrency", 1),
        source=source,
        combos=combos,
        implicit_axes=implicit,
        diagnostics=parse_diagnostics(raw.get("diagnostics")),
    )
    if "kv_dtype" in baseline:
        dtypes = tuple(dict.fromkeys(e.kv.dtype for i, t in enumerate(targets) for e in entries(cfg, t, i)))
        _choice(baseline["kv_dtype"], dtypes, "baseline.kv_dtype")
    check_targets(cfg)
    _check_engine(cfg)
    return cfg


def _models(raw: dict) -> list[str]:
    model = raw.get("model", DEFAULT_MODEL)
    models = [model] if not isinstance(model, list) else model
    return [DEFAULT_MODEL if m is None else expand_env(_str(m, f"model[{i}]"), f"model[{i}]") for i, m in enumerate(_list(models, "model"))]


def _targets(raw: dict, engine_keys: tuple[str, ...]) -> list[TargetSpec]:
    targets_raw = raw.get("targets", [{"name": "embedded", "type": "embedded"}])
    targets = [_target_with_launch(t, f"targets[{i}]", engine_keys) for i, t in enumerate(_list(targets_raw, "targets"))]
    names = [t.name for t in targets]
    if len(set(names)) != len(names):
        _fail("targets", f"target names must be unique, got {names}")
    return targets


def _suites(raw: dict, conc: list[int], targets: list[TargetSpec]) -> tuple[list, int]:
    """The suites and the accuracy concurrency (a level outside ``conc`` needs suites)."""
    suites = [_suite(s, f"suites[{i}]") for i, s in enumerate(raw.get("suites") or [])]
    if len({s.name for s in suites}) != len(suites):
        _fail("suites", "each suite may appear once")
    acc = raw.get("accuracy_concurrency", conc[0])
    acc = _int(acc, "accuracy_concurrency", 1)
    if acc not in conc and not suites:
        _fail("accuracy_concurrency", f"{acc} is not one of the concurrency levels {conc} (a level outside them gets "
                                      "accuracy-only cells, but this sweep has no suites)")
    from kvbench.harness.request_options import check_embedded_suites

    check_embedded_suites(targets, suites)  # a suite's extra_body cannot reach an embedded target
    return suites, acc


def _baseline(raw: dict, names: list[str]) -> dict:
    baseline = dict(_mapping(raw.get("baseline"), "baseline"))
    _check_keys(baseline, (*CELL_KEYS, *kv_option_names()), "baseline")
    baseline = {k: _selector_value(k, v, f"baseline.{k}") for k, v in baseline.items()}
    if "target" in baseline:
        _choice(baseline["target"], tuple(names), "baseline.target")
    return baseline


def _target_with_launch(d: Any, path: str, engine_keys: tuple[str, ...]) -> TargetSpec:
    """A target with its launch options (``engine_kind``, ``option_flags``, ``extra_args``, ``tp_size``,
    ``devices``) and its own ``backends`` list.  ``${VAR}`` / ``${VAR:-default}`` in ``launch`` and ``base_url``
    are environment variables, expanded before the ``{placeholder}`` check."""
    if isinstance(d, dict):
        d = {**d, **{k: expand_env(d[k], f"{path}.{k}") for k in ("launch", "base_url") if isinstance(d.get(k), str)}}
        if isinstance(d.get("base_url"), list):  # replicas: each URL expanded
            d["base_url"] = [expand_env(u, f"{path}.base_url[{i}]") if isinstance(u, str) else u for i, u in enumerate(d["base_url"])]
    t = _target(d, path, engine_keys)
    parse_target_options(t, d, path)
    if d.get("backends") is not None:
        t.backends = [parse_backend_entry(b, f"{path}.backends[{i}]") for i, b in enumerate(_list(d["backends"], f"{path}.backends"))]
        _no_duplicates([b.ident() for b in t.backends], f"{path}.backends")
    return t


def _no_duplicates(vals: list, path: str) -> None:
    if len(set(map(str, vals))) != len(vals):
        _fail(path, "duplicate entries")


def _backend_kv_axes(axes: dict, targets: list[TargetSpec]):
    """``(backends, kv, combos, implicit)`` of the axes: the backend and KV entries, the explicit combinations
    (None: the product), and which of the two axes the config leaves out (targets then run their defaults)."""
    if axes.get("combos") is not None:
        for k in ("backends", "kv"):
            if k in axes:
                _fail(f"axes.{k}", "axes.combos lists the backend and KV entries itself; give either combos or backends/kv")
        for i, t in enumerate(targets):
            if t.backends is not None:
                _fail(f"targets[{i}].backends", "a target's own backends cannot be combined with axes.combos")
        combos = parse_combos(axes["combos"], "axes.combos")
        backends = list({b.ident(): b for b, _ in combos}.values())
        kv = list({kv_ident(k): k for _, k in combos}.values())
        return backends, kv, combos, ()
    implicit = tuple(k for k in ("backends", "kv") if k not in axes)
    backends = [parse_backend_entry(b, f"axes.backends[{i}]") for i, b in enumerate(_list(axes.get("backends", ["torch"]), "axes.backends"))]
    kv = [parse_kv_entry(k, f"axes.kv[{i}]") for i, k in enumerate(_list(axes.get("kv", ["bf16"]), "axes.kv"))]
    _no_duplicates([b.ident() for b in backends], "axes.backends")
    _no_duplicates([kv_ident(k) for k in kv], "axes.kv")
    return backends, kv, None, implicit


def _kv_dict(k: KVSpec) -> dict:
    d = {"dtype": k.dtype, "scales": k.scales, "options": dict(k.options)}
    if k.scales_file:
        d["scales_file"] = k.scales_file
    if k.extra_args:
        d["extra_args"] = k.extra_args
    return d


def _name(value: Any) -> str:
    """The run's name: the default run directory is ``runs/<name>``, so a plain directory name only."""
    name = _str(value, "name")
    if any(sep in name for sep in ("/", "\\", "\0")) or name.strip() in (".", ".."):
        _fail("name", f"{name!r} is not a plain directory name (the default run directory is runs/<name>); "
                      "use no path separators and not . or ..")
    return name


def _check_engine(sweep: SweepConfig) -> None:
    """Build the ``EngineConfig`` of every engine launch the sweep can make and run its validation, so a bad
    ``engine:`` value is a config error naming its key path, before any cell starts (also for --dry-run).
    The top-level section is checked on its own too (it may serve no embedded target)."""
    from kvbench.runtime import ConfigError, EngineConfig

    def check(opts: dict, target: Optional[tuple[int, TargetSpec]]) -> None:
        try:
            EngineConfig(**opts)
        except ConfigError as e:
            f = e.field
            if target is not None and f in target[1].engine:
                path = f"targets[{target[0]}].engine.{f}"
            elif f in engine:
                path = f"engine.{f}"
            else:  # a value the axes set (already checked by the schema): name the target
                path = f"targets[{target[0]}]" if target is not None else "engine"
            _fail(path, str(e))
        except TypeError as e:  # not a keyword EngineConfig takes (keys are checked before; defensive)
            _fail("engine", str(e))

    from kvbench.core import BACKEND_SPECS, is_supported, supported_formats

    engine = sweep.engine
    check(dict(engine), None)
    for i, t in enumerate(sweep.targets):
        if t.type != "embedded":
            continue
        unsupported: list[str] = []
        for model in sweep.models:
            for e in entries(sweep, t, i):
                check({**engine, **t.engine, "model": None if model == DEFAULT_MODEL else model,
                       "kv_dtype": e.kv.dtype, "kv_scales": e.kv.scales, "prefill_backend": e.backends[0],
                       "decode_backend": e.backends[1], **e.kv.options}, (i, t))
                # the backend table (core/backends.py) says which formats each backend runs per phase: a pair
                # it refuses would only fail when its cell starts (MLA support is checked there, per model)
                for phase, backend in (("prefill", e.backends[0]), ("decode", e.backends[1])):
                    if backend in BACKEND_SPECS and not is_supported(backend, e.kv.dtype, phase):
                        what = (f"{e.backends[0]}+{e.backends[1]} x {e.kv.dtype}: the {backend} backend does not run "
                                f"{e.kv.dtype} for {phase} (it runs {', '.join(supported_formats(backend, phase))})")
                        if what not in unsupported:
                            unsupported.append(what)
        if unsupported:
            where = "axes.combos" if sweep.combos else "axes"
            _fail(where, f"target {t.name!r} (embedded) cannot run {len(unsupported)} backend x KV pair"
                         f"{'s' if len(unsupported) != 1 else ''} of the matrix: {'; '.join(unsupported)}; list the pairs "
                         "that run under axes.combos (or drop those backends / formats)")


def load_config(path: str | Path) -> SweepConfig:
    """Read and validate a sweep YAML file (clear errors for missing files and bad YAML too)."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise SweepConfigError(f"{path}: no such config file")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise SweepConfigError(f"{path}: invalid YAML ({e})") from None
    try:
        return parse_config(raw, source=str(p))
    except SweepConfigError as e:
        raise SweepConfigError(f"{p.name}: {e}") from None
