"""Sweep configuration: the YAML schema of ``configs/*.yaml`` and its validation.

A sweep is the matrix model × target × backend pair × KV format (with scale policy) × concurrency, plus
what each cell runs (accuracy suites, the fidelity suite, a load test), the baseline cell and the gate
thresholds.  Every unknown key and bad value is reported with its path in the file and the allowed
choices.  No torch here: ``kvbench sweep --help`` imports this module.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from kvbench.harness.config_checks import (SweepConfigError, _bool, _check_keys, _choice, _fail, _int, _list,
                                           _mapping, _num, _str)
from kvbench.harness.sweep_specs import (CELL_KEYS, DEFAULT_MODEL, KV_ENTRY_OPTIONS, SLO_KEYS, GateSpec, KVSpec,
                                         LoadSpec, SuiteSpec, TargetSpec, _backend_pair, _gate, _kv_entry, _load,
                                         _suite, _target)

__all__ = ["SweepConfig", "SweepConfigError", "parse_config", "load_config", "CELL_KEYS", "DEFAULT_MODEL",
           "SuiteSpec", "TargetSpec"]


# ------------------------------------------------------------------------------ the config
@dataclass
class SweepConfig:
    name: str
    models: list[str]
    engine: dict
    targets: list[TargetSpec]
    backends: list[tuple[str, str]]
    kv: list[KVSpec]
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
    # batching): the run's noise floor (reports/discriminative.py); on by default when the sweep has suites
    aa_control: bool = True
    aa_concurrency: Optional[int] = None  # None: half the accuracy concurrency (2 when that is 1)
    source: Optional[str] = None  # the file it came from (not part of to_dict)

    def to_dict(self) -> dict:
        """Plain, JSON-safe form (recorded in the manifest; compared on --resume)."""
        d = asdict(self)
        d.pop("source")
        d["backends"] = [list(p) for p in self.backends]
        d["load"]["request_rate"] = "inf" if math.isinf(self.load.request_rate) else self.load.request_rate
        return d

    def target(self, name: str) -> TargetSpec:
        for t in self.targets:
            if t.name == name:
                return t
        raise KeyError(name)


_TOP_KEYS = (
    "name", "description", "model", "engine", "targets", "axes", "accuracy_concurrency", "suites", "load",
    "slo", "baseline", "gate", "data_dir", "seed", "aa_control", "aa_concurrency",
)
_AXES_KEYS = ("backends", "kv", "concurrency")
# engine options the sweep controls per cell (set through the axes, not through `engine:`)
_AXIS_ENGINE_KEYS = ("model", "kv_dtype", "kv_scales", "prefill_backend", "decode_backend", *KV_ENTRY_OPTIONS)


def _engine_keys() -> tuple[str, ...]:
    from dataclasses import fields

    from kvbench.runtime.config import EngineConfig

    return tuple(f.name for f in fields(EngineConfig) if f.name not in _AXIS_ENGINE_KEYS)


def parse_config(raw: Any, source: Optional[str] = None) -> SweepConfig:
    """Validate a parsed YAML document and build the ``SweepConfig``."""
    if raw is None:  # yaml.safe_load of an empty (or comments-only) file
        _fail("config", "expected a mapping, got an empty file")
    raw = _mapping(raw, "config")
    _check_keys(raw, _TOP_KEYS, "config")
    engine_keys = _engine_keys()
    engine = dict(_mapping(raw.get("engine"), "engine"))
    _check_keys(engine, engine_keys, "engine")

    model = raw.get("model", DEFAULT_MODEL)
    models = [model] if not isinstance(model, list) else model
    models = [DEFAULT_MODEL if m is None else _str(m, f"model[{i}]") for i, m in enumerate(_list(models, "model"))]

    targets_raw = raw.get("targets", [{"name": "embedded", "type": "embedded"}])
    targets = [_target(t, f"targets[{i}]", engine_keys) for i, t in enumerate(_list(targets_raw, "targets"))]
    names = [t.name for t in targets]
    if len(set(names)) != len(names):
        _fail("targets", f"target names must be unique, got {names}")

    axes = _mapping(raw.get("axes"), "axes")
    _check_keys(axes, _AXES_KEYS, "axes")
    backends = [_backend_pair(b, f"axes.backends[{i}]") for i, b in enumerate(_list(axes.get("backends", ["torch"]), "axes.backends"))]
    kv = [_kv_entry(k, f"axes.kv[{i}]") for i, k in enumerate(_list(axes.get("kv", ["bf16"]), "axes.kv"))]
    conc = [_int(c, f"axes.concurrency[{i}]", 1) for i, c in enumerate(_list(axes.get("concurrency", [1]), "axes.concurrency"))]
    for what, vals in (("backends", backends), ("concurrency", conc), ("kv", [(k.dtype, k.scales, sorted(k.options.items())) for k in kv])):
        if len(set(map(str, vals))) != len(vals):
            _fail(f"axes.{what}", "duplicate entries")
    acc = raw.get("accuracy_concurrency", conc[0])
    acc = _int(acc, "accuracy_concurrency", 1)
    if acc not in conc:
        _fail("accuracy_concurrency", f"{acc} is not one of the concurrency levels {conc}")

    suites = [_suite(s, f"suites[{i}]") for i, s in enumerate(raw.get("suites") or [])]
    if len({s.name for s in suites}) != len(suites):
        _fail("suites", "each suite may appear once")
    load = _load(raw.get("load"), "load")

    slo = dict(_mapping(raw.get("slo"), "slo"))
    _check_keys(slo, SLO_KEYS, "slo")
    slo = {k: _num(v, f"slo.{k}", 1e-9) for k, v in slo.items()}

    baseline = dict(_mapping(raw.get("baseline"), "baseline"))
    _check_keys(baseline, CELL_KEYS, "baseline")
    baseline = {k: str(v) for k, v in baseline.items()}
    if "kv_dtype" in baseline:
        _choice(baseline["kv_dtype"], tuple(dict.fromkeys(k.dtype for k in kv)), "baseline.kv_dtype")
    if "target" in baseline:
        _choice(baseline["target"], tuple(names), "baseline.target")

    data_dir = raw.get("data_dir")
    if data_dir is not None:
        data_dir = _str(data_dir, "data_dir")  # relative paths are relative to the working directory
    _check_engine(engine, targets, models, backends, kv)
    return SweepConfig(
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
        aa_control=_bool(raw.get("aa_control", bool(suites)), "aa_control"),
        aa_concurrency=None if raw.get("aa_concurrency") is None else _int(raw["aa_concurrency"], "aa_concurrency", 1),
        source=source,
    )


def _name(value: Any) -> str:
    """The run's name: the default run directory is ``runs/<name>``, so a plain directory name only."""
    name = _str(value, "name")
    if any(sep in name for sep in ("/", "\\", "\0")) or name.strip() in (".", ".."):
        _fail("name", f"{name!r} is not a plain directory name (the default run directory is runs/<name>); "
                      "use no path separators and not . or ..")
    return name


def _check_engine(engine: dict, targets: list[TargetSpec], models: list[str], backends: list[tuple[str, str]],
                  kv: list[KVSpec]) -> None:
    """Build the ``EngineConfig`` of every engine launch the sweep can make and run its validation, so a bad
    ``engine:`` value is a config error naming its key path, before any cell starts (also for --dry-run).
    The top-level section is checked on its own too (it may serve no embedded target)."""
    from kvbench.runtime.config import ConfigError, EngineConfig

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

    check(dict(engine), None)
    for i, t in enumerate(targets):
        if t.type != "embedded":
            continue
        for model in models:
            for prefill, decode in backends:
                for k in kv:
                    check({**engine, **t.engine, "model": None if model == DEFAULT_MODEL else model,
                           "kv_dtype": k.dtype, "kv_scales": k.scales, "prefill_backend": prefill,
                           "decode_backend": decode, **k.options}, (i, t))


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
