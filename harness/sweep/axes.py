"""The axes of a sweep: backend entries, KV entries, explicit combinations, and which of them each target runs.

* A **backend entry** is ``NAME``, ``PREFILL+DECODE``, or a mapping ``{backend: NAME | PREFILL+DECODE}`` /
  ``{prefill: NAME, decode: NAME}`` with optional ``extra_args`` (launch arguments for server targets).
  Names are free strings, passed verbatim to server targets (``trtllm_mha``, ``fa3``, ``FLASHINFER``, ...);
  embedded targets accept only the embedded engine's backends (``kvbench.core.backends``).  ``default`` is the engine's
  own choice (passes nothing).
* A **KV entry** is ``DTYPE`` or ``{dtype, scales, scales_file, extra_args, kv_scales_per_head,
  quantize_query, fused_append, kv_dtype_skip_layers, kv_layer_dtypes}``; ``dtype: auto`` keeps a server's
  default cache dtype (passes nothing); ``scales_file`` (a quantization-param file) implies ``scales:
  checkpoint``; ``quantize_query`` is false | true (= both) | prefill | decode | both; the per-layer formats
  (layers kept in bf16: ``[0, 1, 31]``, ``"0-3,sliding_window"``; other formats per layer group:
  ``"0-3:nvfp4;31:bf16"``) are stored canonical (``kvbench.core.layer_formats``), so spellings of one set
  are one cell; empty ones are left out.
* ``axes.combos: [{backends: ENTRY, kv: ENTRY}, ...]`` replaces the product backends x kv with explicit pairs.
* A target's own ``backends:`` list replaces ``axes.backends`` for that target.  Without ``axes.backends`` /
  ``axes.kv`` a server target runs ``default`` / ``auto`` (nothing passed) and other targets ``torch`` / ``bf16``.

``check_targets`` validates every (target, backend entry, KV entry) a sweep can run: registry names and
engine options on embedded targets, launch arguments on endpoint targets (none can reach them), and for
server targets that every option reaches the launch (``launch_options.check_cell``).  No torch here.
"""

from __future__ import annotations

from typing import Any, Iterator, NamedTuple

from kvbench.core import backend_names
from kvbench.core import KV_SCALE_POLICIES, canonical_format, format_names
from kvbench.harness.config_checks import _bool, _check_keys, _choice, _fail, _list, _mapping, _str
from kvbench.core import kv_option, kv_option_names, list_valued_options
from kvbench.harness.launch.options import AUTO_KV, DEFAULT_BACKEND, check_cell, entry_keys, shell_args
from kvbench.harness.layer_options import check_model_layers, check_model_layers_overlap
from kvbench.harness.sweep.specs import DEFAULT_MODEL, KVSpec, TargetSpec


def kv_dtype_choices() -> tuple[str, ...]:
    """A KV entry's dtype: a registered format, or ``auto`` (a server's default)."""
    return (*format_names(), AUTO_KV)

def _engine_spelling(dtype: Any) -> Any:
    """A KV dtype as vLLM / SGLang spell it (fp8, bfloat16, FP8_E4M3, ...) -> the format's name, so the cell
    (and its key) is the same as with our spelling; ``auto`` stays the server's default."""
    if isinstance(dtype, str) and dtype.strip().lower() != AUTO_KV:
        try:
            return canonical_format(dtype)
        except ValueError:
            pass  # _choice names the key and the choices
    return dtype


_KV_KEYS = ("dtype", "scales", "scales_file", "extra_args")  # + the KV options (kvbench.core.kv_config)


class BackendPair(tuple):
    """A backend entry: ``(prefill, decode)`` (it compares, hashes and unpacks as that 2-tuple) plus the
    ``extra_args`` it adds to a server's launch."""

    extra_args: str

    def __new__(cls, prefill, decode=None, extra_args: str = ""):
        if decode is None and not isinstance(prefill, str):  # BackendPair(iterable), as copy/asdict call it
            prefill, decode = tuple(prefill)[:2]
        self = super().__new__(cls, (prefill, decode))
        self.extra_args = extra_args
        return self

    def __getnewargs__(self):
        return (self[0], self[1], self.extra_args)

    def ident(self) -> tuple:
        return (self[0], self[1], self.extra_args)

    def to_json(self) -> list:
        return [self[0], self[1], *([self.extra_args] if self.extra_args else [])]

    def with_args(self, extra_args: str) -> "BackendPair":
        return BackendPair(self[0], self[1], extra_args)


class Entry(NamedTuple):
    """One (backend entry, KV entry) a target runs, with the key paths that set them (for errors)."""

    backends: BackendPair
    kv: KVSpec
    bpath: str
    kpath: str


# ------------------------------------------------------------------------------ parsing
def _name(value: Any, path: str) -> str:
    name = _str(value, path)
    if any(c.isspace() for c in name) or "+" in name or "{" in name or "}" in name:
        _fail(path, f"{name!r} is not a backend name (no spaces, '+' or braces)")
    return name


def parse_backend_entry(d: Any, path: str) -> BackendPair:
    """``NAME`` | ``PREFILL+DECODE`` | ``{backend: ..., extra_args}`` | ``{prefill, decode, extra_args}``."""
    extra = ""
    if isinstance(d, dict):
        _check_keys(d, ("backend", "prefill", "decode", "extra_args"), path)
        if d.get("extra_args") is not None:
            extra = shell_args(d["extra_args"], f"{path}.extra_args")
        if "backend" in d:
            if "prefill" in d or "decode" in d:
                _fail(path, "give either backend or prefill and decode, not both")
            return parse_backend_entry(_str(d["backend"], f"{path}.backend"), f"{path}.backend").with_args(extra)
        return BackendPair(_name(d.get("prefill"), f"{path}.prefill"), _name(d.get("decode"), f"{path}.decode"), extra)
    if not isinstance(d, str):
        _fail(path, f"expected BACKEND or PREFILL+DECODE, got {type(d).__name__} {d!r}")
    parts = d.split("+")
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2:
        _fail(path, f"expected BACKEND or PREFILL+DECODE, got {d!r}")
    return BackendPair(_name(parts[0], path), _name(parts[1], path))


def parse_kv_entry(d: Any, path: str) -> KVSpec:
    if isinstance(d, str):
        d = {"dtype": d}
    d = _mapping(d, path)
    _check_keys(d, (*_KV_KEYS, *kv_option_names()), path)
    dtype = _choice(_engine_spelling(d.get("dtype")), kv_dtype_choices(), f"{path}.dtype")
    scales_file = None
    if d.get("scales_file") is not None:
        scales_file = _str(d["scales_file"], f"{path}.scales_file")
    scales = _choice(d.get("scales", "checkpoint" if scales_file else "unit"), KV_SCALE_POLICIES, f"{path}.scales")
    if scales_file and scales != "checkpoint":
        _fail(f"{path}.scales", f"a scales_file gives the scales: use scales: checkpoint (or leave scales out), got {scales!r}")
    options = {}
    for k in kv_option_names():
        if k not in d:
            continue
        if kv_option(k).boolean and not isinstance(d[k], bool):
            _bool(d[k], f"{path}.{k}")  # YAML true / false only
        try:
            value = kv_option(k).parse(d[k])
        except ValueError as e:
            _fail(f"{path}.{k}", str(e))
        if value is not None:  # e.g. nothing skipped = the uniform cell (same key as without the option)
            options[k] = value
    if all(k in options for k in list_valued_options()):
        try:
            check_model_layers_overlap(options["kv_dtype_skip_layers"], options["kv_layer_dtypes"])
        except ValueError as e:
            _fail(path, str(e))
    extra = shell_args(d["extra_args"], f"{path}.extra_args") if d.get("extra_args") is not None else ""
    return KVSpec(dtype, scales, options, scales_file=scales_file, extra_args=extra)


def kv_ident(k: KVSpec) -> str:
    return str((k.dtype, k.scales, sorted(k.options.items()), k.scales_file, k.extra_args))


def parse_combos(value: Any, path: str) -> list[tuple[BackendPair, KVSpec]]:
    out = []
    for i, c in enumerate(_list(value, path)):
        p = f"{path}[{i}]"
        c = _mapping(c, p)
        _check_keys(c, ("backends", "kv"), p)
        for k in ("backends", "kv"):
            if c.get(k) is None:
                _fail(f"{p}.{k}", "missing: a combination names a backend entry and a KV entry")
        out.append((parse_backend_entry(c["backends"], f"{p}.backends"), parse_kv_entry(c["kv"], f"{p}.kv")))
    seen = [(b.ident(), kv_ident(k)) for b, k in out]
    if len(set(map(str, seen))) != len(seen):
        _fail(path, "duplicate entries")
    return out


# ------------------------------------------------------------------------------ entries per target
def default_entries(ttype: str) -> tuple[BackendPair, KVSpec]:
    """What a target runs when the config gives no backend / KV axis."""
    if ttype == "server":
        return BackendPair(DEFAULT_BACKEND, DEFAULT_BACKEND), KVSpec(AUTO_KV)
    return BackendPair("torch", "torch"), KVSpec("bf16")


def entries(sweep, target: TargetSpec, tindex: int = 0) -> Iterator[Entry]:
    """The (backend entry, KV entry) pairs ``target`` runs, in matrix order (backends outer, kv inner)."""
    implicit = getattr(sweep, "implicit_axes", ())
    if getattr(sweep, "combos", None):
        for i, (b, k) in enumerate(sweep.combos):
            yield Entry(b, k, f"axes.combos[{i}].backends", f"axes.combos[{i}].kv")
        return
    dflt_b, dflt_k = default_entries(target.type)
    if target.backends is not None:
        bs = [(b, f"targets[{tindex}].backends[{i}]") for i, b in enumerate(target.backends)]
    elif "backends" in implicit:
        bs = [(dflt_b, "axes.backends")]
    else:
        bs = [(b, f"axes.backends[{i}]") for i, b in enumerate(sweep.backends)]
    ks = [(dflt_k, "axes.kv")] if "kv" in implicit else [(k, f"axes.kv[{i}]") for i, k in enumerate(sweep.kv)]
    for b, bp in bs:
        for k, kp in ks:
            yield Entry(b, k, bp, kp)


def cell_fields(b: BackendPair, k: KVSpec) -> dict:
    """The cell config keys an entry sets (besides model, target, concurrency)."""
    out = {"prefill_backend": b[0], "decode_backend": b[1], "kv_dtype": k.dtype, "kv_scales": k.scales}
    if k.options:
        out["options"] = dict(sorted(k.options.items()))
    if k.scales_file:
        out["scales_file"] = k.scales_file
    extra = " ".join(a for a in (b.extra_args, k.extra_args) if a)
    if extra:
        out["extra_args"] = extra
    return out


# ------------------------------------------------------------------------------ checks
def check_targets(sweep) -> None:
    """Every entry of every target can run as its cell says (``SweepConfigError`` otherwise)."""
    for ti, t in enumerate(sweep.targets):
        for e in entries(sweep, t, ti):
            if t.type == "embedded":
                _check_embedded(t, ti, e)
                _check_layers(sweep.models, e)
            elif t.type == "endpoint":
                _check_endpoint(t, ti, e)
            else:
                fields = cell_fields(e.backends, e.kv)
                cell = {"model": "m", **fields}
                where = {"kv_dtype": f"{e.kpath}.dtype", "kv_scales": f"{e.kpath}.scales",
                         "scales_file": f"{e.kpath}.scales_file", "prefill_backend": e.bpath, "decode_backend": e.bpath}
                where.update({o: f"{e.kpath}.{o}" for o in kv_option_names()})
                where.update({o: f"{e.kpath}.{k}" for o, k in entry_keys().items()})
                check_cell(t, f"targets[{ti}]", cell, where)


def _check_layers(models: list, e: Entry) -> None:
    """Per-layer formats against each model whose layers are known before it loads (``synthetic:`` names,
    local directories with a config.json): a layer it does not have is refused now, not at engine start."""
    opts = e.kv.options
    skip, per_layer = opts.get("kv_dtype_skip_layers"), opts.get("kv_layer_dtypes")
    if not skip and not per_layer:
        return
    for model in models:
        try:
            check_model_layers(None if model == DEFAULT_MODEL else model, e.kv.dtype, skip, per_layer)
        except ValueError as err:
            msg = str(err)
            key = next((k for k in list_valued_options() if msg.startswith(k)), None)
            if key is not None and (skip if key == "kv_dtype_skip_layers" else per_layer):
                _fail(f"{e.kpath}.{key}", msg[len(key):].lstrip(" :"))
            _fail(e.kpath, msg if model in msg else f"model {model}: {msg}")


def _check_embedded(t: TargetSpec, ti: int, e: Entry) -> None:
    name = f"embedded target {t.name!r} (targets[{ti}])"
    for n in e.backends[:2]:
        if n not in backend_names():
            _fail(e.bpath, f"{n!r} is not a backend of the embedded engine ({name}); choose one of: "
                           f"{', '.join(backend_names())} (engine names such as trtllm_mha belong to server targets: give "
                           "those their own backends: list)")
    if e.kv.dtype == AUTO_KV:
        _fail(f"{e.kpath}.dtype", f"{AUTO_KV!r} (a server's default cache dtype) does not apply to {name}; "
                                  f"choose one of: {', '.join(format_names())}")
    for what, path in ((e.backends.extra_args, f"{e.bpath}.extra_args"), (e.kv.extra_args, f"{e.kpath}.extra_args")):
        if what:
            _fail(path, f"{name} launches no server, so launch arguments cannot reach it")
    if e.kv.scales_file:
        _fail(f"{e.kpath}.scales_file", f"the embedded engine takes no scales file ({name}); its scales are "
                                        f"{', '.join(KV_SCALE_POLICIES)}")
    from dataclasses import fields

    from kvbench.runtime import EngineConfig

    acts = {f.name for f in fields(EngineConfig)}
    for k in e.kv.options:
        if k not in acts:  # a KV option only server targets carry (kvbench.core.kv_config registers it)
            _fail(f"{e.kpath}.{k}", f"the embedded engine does not act on {k} ({name}); give it to a server target "
                                    "whose launch carries it")


def _check_endpoint(t: TargetSpec, ti: int, e: Entry) -> None:
    name = f"endpoint target {t.name!r} (targets[{ti}])"
    for what, path in ((e.backends.extra_args, f"{e.bpath}.extra_args"), (e.kv.extra_args, f"{e.kpath}.extra_args"),
                       (e.kv.scales_file, f"{e.kpath}.scales_file")):
        if what:
            _fail(path, f"nothing is launched for {name}, so this cannot reach it")
