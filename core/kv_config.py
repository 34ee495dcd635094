"""A KV-cache configuration as one typed value, and the registry of its options.

``KVConfig`` is what a sweep's KV entry, a cell, an ``EngineConfig``, a server launch and a report label all
describe: the format (``dtype``), where its scales come from (``scales`` policy, ``scales_file``), the options
a KV entry may set (``KV_OPTIONS``: per-head scales, query quantization per phase, fused append, per-layer
formats) and the attention backends of each phase.  A cell's config dict holds the same facts under the
store's keys (``kv_dtype``, ``kv_scales``, ``scales_file``, ``options``, ``prefill_backend``,
``decode_backend``): ``KVConfig.from_cell`` / ``cell_fields`` convert, so cell keys of old runs do not change.

An option is declared once, here (``KVOption``): its default, how a value is canonicalized (YAML, flag and
selector spellings → one value, so one cell key), how labels show it, whether its value is a layer set, and
the ``EngineConfig`` field it sets.  The sweep parser, selectors, cell labels, launch rendering and the engine
config read the registry; adding an option is ``register_kv_option`` (or one more entry below) plus the code
where it acts (docs/architecture.md "Adding a KV option").

Torch-free; imports nothing above core.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from kvbench.core.io import canonical_key
from kvbench.core.layer_formats import canonical_layer_dtypes, canonical_skip_layers

__all__ = ["QUERY_QUANT_MODES", "KVOption", "KVConfig", "KV_OPTIONS", "register_kv_option", "unregister_kv_option",
           "kv_option", "kv_option_names", "is_kv_option", "list_valued_options", "query_quant_mode",
           "query_quant_phases", "options_text", "REFERENCE_DTYPE"]

QUERY_QUANT_MODES = ("none", "prefill", "decode", "both")
REFERENCE_DTYPE = "bf16"  # the reference (baseline) configuration's format: unquantized, no options


def query_quant_mode(value: Any) -> str:
    """``quantize_query`` as a mode: True → both, False/None → none, a mode name (any case) → itself;
    ``ValueError`` otherwise."""
    if value is True:
        return "both"
    if value is False or value is None:
        return "none"
    if isinstance(value, str) and value.strip().lower() in QUERY_QUANT_MODES:
        return value.strip().lower()
    raise ValueError(f"{value!r} is not a quantize_query mode; choose one of: false, true, prefill, decode, both")


def query_quant_phases(mode: Any) -> tuple[bool, bool]:
    """``(prefill, decode)``: whether each phase's queries go through fp8 under ``mode``."""
    m = query_quant_mode(mode)
    return m in ("prefill", "both"), m in ("decode", "both")


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ValueError(f"expected true or false, got {value!r}")


def _query_cell_value(value: Any):
    """``quantize_query`` as a cell records it: false / true (both) / "prefill" / "decode"."""
    return {"none": False, "both": True}.get(query_quant_mode(value), query_quant_mode(value))


def _flag_label(name: str, value: Any) -> str:
    """``+name`` / ``+name=value`` (nothing when the value is falsy)."""
    if not value:
        return ""
    return f"+{name}" if value is True else f"+{name}={value}"


@dataclass(frozen=True)
class KVOption:
    """One option of a KV configuration.

    ``parse`` turns any accepted spelling (YAML value, flag text, selector text) into the canonical value a
    cell records, or ``None`` for "not set" (the cell then has the same key as without it); ``ValueError``
    says why a value is refused.  ``engine_value`` turns a cell value into its ``EngineConfig`` field's value;
    ``label`` is the text a cell label shows (``""`` hides it).  ``layer_word`` marks a per-layer option: its
    value is a layer set (commas continue it in selectors) and labels show it last as ``WORD VALUE``.
    ``launch_name`` is the placeholder / option_flags name in server launch templates and ``launch_text``
    its text (``launch_default`` when the cell does not set it)."""

    name: str
    default: Any
    parse: Callable[[Any], Any]
    engine_value: Callable[[Any], Any] = lambda v: v
    label: Optional[Callable[[str, Any], str]] = None
    layer_word: Optional[str] = None
    launch_name: Optional[str] = None
    launch_text: Callable[[Any], Optional[str]] = lambda v: None if v is None else str(v)
    template: bool = False  # a launch template may name it as {placeholder} (else: option_flags only)
    boolean: bool = False  # true / false only (YAML booleans in a sweep, bool in EngineConfig)
    help: str = ""

    @property
    def per_layer(self) -> bool:
        return self.layer_word is not None

    @property
    def flag_choices(self) -> Optional[tuple]:
        """The values a value-keyed option_flags entry may key (None: any)."""
        return ("true", "false") if self.boolean else None

    @property
    def placeholder(self) -> str:
        return self.launch_name or self.name

    def label_text(self, value: Any) -> str:
        if self.layer_word is not None:
            return f"{self.layer_word} {value}" if value else ""
        return (self.label or _flag_label)(self.name, value)

    def launch_value(self, value: Any) -> Optional[str]:
        """The option's text in a launch command for a cell value (``None``: not set)."""
        return self.launch_text(self.default if value is None else value)

    def launch_key(self, key: Any) -> str:
        """A value-keyed option_flags key as launch text (YAML true/false, quantize_query's both/none ...)."""
        try:
            return str(self.launch_value(self.parse(key)))
        except ValueError:
            return str(key)


def _bool_text(value: Any) -> str:
    return "true" if value else "false"


KV_OPTIONS: dict[str, KVOption] = {}


def register_kv_option(option: KVOption) -> KVOption:
    """Add an option to the registry (a name already taken is a ``ValueError``)."""
    if option.name in KV_OPTIONS:
        raise ValueError(f"KV option {option.name!r} is already registered")
    KV_OPTIONS[option.name] = option
    return option


def unregister_kv_option(name: str) -> None:
    KV_OPTIONS.pop(name, None)


for _opt in (
    KVOption("kv_scales_per_head", False, _as_bool, launch_text=_bool_text, boolean=True,
             help="calibrate one scale per kv-head instead of per layer"),
    KVOption("quantize_query", False, _query_cell_value, engine_value=query_quant_mode,
             launch_text=query_quant_mode, template=True, help="fp8 queries: false, true (= both), prefill, decode, both"),
    KVOption("fused_append", True, _as_bool, launch_text=_bool_text, boolean=True,
             help="the fused RoPE+quantize+append kernel (true) or the unfused path"),
    KVOption("kv_dtype_skip_layers", None, canonical_skip_layers, layer_word="skip", launch_name="kv_skip_layers", template=True,
             help="layers kept in bf16 (indices, ranges, sliding_window / full_attention)"),
    KVOption("kv_layer_dtypes", None, canonical_layer_dtypes, layer_word="layers",
             help="other formats per layer group: LAYERS:FORMAT;..."),
):
    register_kv_option(_opt)


def kv_option(name: str) -> KVOption:
    return KV_OPTIONS[name]


def kv_option_names() -> tuple[str, ...]:
    return tuple(KV_OPTIONS)


def is_kv_option(name: str) -> bool:
    return name in KV_OPTIONS


def list_valued_options() -> tuple[str, ...]:
    """Options whose values are layer sets (they hold commas)."""
    return tuple(n for n, o in KV_OPTIONS.items() if o.per_layer)


def _option_parts(options: Optional[dict]) -> tuple[str, str]:
    """(flags, per-layer text) of a KV entry's options: ``+quantize_query=decode``, ``skip 0,1,31``."""
    opts = options or {}
    flags = "".join(KV_OPTIONS[n].label_text(v) if n in KV_OPTIONS else _flag_label(n, v)
                    for n, v in opts.items() if not (n in KV_OPTIONS and KV_OPTIONS[n].per_layer))
    layers = " ".join(t for t in (KV_OPTIONS[n].label_text(opts.get(n)) for n in list_valued_options()) if t)
    return flags, layers


def options_text(options: Optional[dict]) -> str:
    """A KV entry's options as labels show them: ``+quantize_query=decode skip 0,1,31`` (flags in the entry's
    order, falsy ones hidden, then the per-layer formats)."""
    return " ".join(p for p in _option_parts(options) if p)


@dataclass(frozen=True)
class KVConfig:
    """A KV-cache configuration: format, scale source, options (canonical values of the options the entry
    set, sorted by name), backends of each phase."""

    dtype: str = REFERENCE_DTYPE
    scales: str = "unit"
    options: tuple = ()  # ((name, canonical value), ...) sorted by name
    prefill_backend: Optional[str] = None
    decode_backend: Optional[str] = None
    scales_file: Optional[str] = None

    @classmethod
    def make(cls, dtype: str = REFERENCE_DTYPE, scales: str = "unit", options: Optional[dict] = None,
             prefill_backend: Optional[str] = None, decode_backend: Optional[str] = None,
             scales_file: Optional[str] = None) -> "KVConfig":
        """A configuration from loose values: options canonicalized (``ValueError`` naming the option for a
        bad value or an unknown name); an option parsed to ``None`` is not set."""
        return cls(dtype, scales, _canonical_options(options or {}), prefill_backend, decode_backend, scales_file)

    # ---- the cell's dict form (the store's keys; cell keys of existing runs depend on it)
    @classmethod
    def from_cell(cls, config: dict) -> "KVConfig":
        return cls(config["kv_dtype"], config.get("kv_scales", "unit"),
                   tuple(sorted((config.get("options") or {}).items())), config.get("prefill_backend"),
                   config.get("decode_backend"), config.get("scales_file"))

    def cell_fields(self) -> dict:
        """The cell config keys this configuration sets (``options`` / ``scales_file`` only when set)."""
        out: dict[str, Any] = {}
        if self.prefill_backend is not None:
            out["prefill_backend"] = self.prefill_backend
        if self.decode_backend is not None:
            out["decode_backend"] = self.decode_backend
        out["kv_dtype"], out["kv_scales"] = self.dtype, self.scales
        if self.options:
            out["options"] = dict(self.options)
        if self.scales_file:
            out["scales_file"] = self.scales_file
        return out

    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "scales": self.scales, "options": dict(self.options),
                "prefill_backend": self.prefill_backend, "decode_backend": self.decode_backend,
                "scales_file": self.scales_file}

    @classmethod
    def from_dict(cls, d: dict) -> "KVConfig":
        return cls.make(d.get("dtype", REFERENCE_DTYPE), d.get("scales", "unit"), d.get("options"),
                        d.get("prefill_backend"), d.get("decode_backend"), d.get("scales_file"))

    def key(self) -> str:
        return canonical_key(self.cell_fields())

    # ---- options
    def option(self, name: str) -> Any:
        """The option's cell value, its default when the configuration does not set it."""
        return dict(self.options).get(name, KV_OPTIONS[name].default)

    def with_options(self, **changes: Any) -> "KVConfig":
        opts = dict(self.options)
        opts.update(changes)
        return replace(self, options=_canonical_options(opts))

    def engine_fields(self) -> dict:
        """``EngineConfig`` keyword arguments: format, scale policy, backends when set, every option (its
        default when not set)."""
        out = {"kv_dtype": self.dtype, "kv_scales": self.scales}
        if self.prefill_backend is not None:
            out["prefill_backend"] = self.prefill_backend
        if self.decode_backend is not None:
            out["decode_backend"] = self.decode_backend
        for name, opt in KV_OPTIONS.items():
            out[name] = opt.engine_value(self.option(name))
        return out

    # ---- labels
    def label(self) -> str:
        """``fp8_e4m3/checkpoint@scales.json+quantize_query=decode skip 0,1,31``."""
        sf = self.scales_file
        at = "@" + sf.rstrip("/").rsplit("/", 1)[-1] if sf else ""
        flags, layers = _option_parts(dict(self.options))
        return f"{self.dtype}/{self.scales}{at}{flags}{(' ' + layers) if layers else ''}"

    @property
    def backend_label(self) -> str:
        p, d = self.prefill_backend, self.decode_backend
        return str(p) if p == d else f"{p}+{d}"

    # ---- the reference
    def reference(self, backend: Optional[str] = None) -> "KVConfig":
        """The reference (baseline) configuration this one is compared with: unquantized, unit scales, no
        options; the same backends unless ``backend`` names one for both phases."""
        p = backend if backend is not None else self.prefill_backend
        d = backend if backend is not None else self.decode_backend
        return KVConfig(REFERENCE_DTYPE, "unit", (), p, d, None)

    @property
    def is_reference(self) -> bool:
        return self.dtype == REFERENCE_DTYPE and not self.options and self.scales == "unit"


def _canonical_options(options: dict) -> tuple:
    out = {}
    for name, value in options.items():
        opt = KV_OPTIONS.get(name)
        if opt is None:
            raise ValueError(f"unknown KV option {name!r}; known: {', '.join(KV_OPTIONS)}")
        try:
            v = opt.parse(value)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        if v is not None:
            out[name] = v
    return tuple(sorted(out.items()))
