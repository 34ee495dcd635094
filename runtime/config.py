"""Engine and KV-cache configuration (validated dataclasses; no torch import at module level)."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Optional

from kvbench.core import backend_names
from kvbench.core import KV_SCALE_POLICIES, format_names, get_spec
from kvbench.core import KV_OPTIONS, QUERY_QUANT_MODES, KVConfig, query_quant_mode

if TYPE_CHECKING:
    from kvbench.runtime.layer_groups import LayerGroups

# KV formats and attention backends are the tables' (kvbench.core.formats / core.backends): read them when
# validating, so a format registered after this import is accepted too.

# page layouts: head-major pages (HND, each kv head's tokens of a page contiguous) or token-major (NHD)
KV_LAYOUTS = ("HND", "NHD")
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
# the library of the linear layers on a CUDA GPU: torch's BLAS, or the few-row Triton GEMM (``runtime/gemm_library.py``)
GEMM_LIBRARIES = ("cublas", "cublaslt", "triton")
# which attention phases round the query through float8_e4m3fn (True = "both", False = "none")


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which and what is allowed.  ``field`` names the
    offending option when there is one (the sweep config maps it to its key path in the file)."""

    def __init__(self, message: str, field: Optional[str] = None):
        super().__init__(message)
        self.field = field


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not supported; choose one of: {', '.join(map(str, allowed))}", name)


def normalize_quantize_query(value, name: str = "quantize_query") -> str:
    """The canonical ``quantize_query`` mode (``kvbench.core.kv_config.query_quant_mode``: ``True`` -> ``"both"``,
    ``False`` -> ``"none"``, a mode name in any case -> itself); anything else is a ``ConfigError`` naming ``name``."""
    try:
        if not isinstance(value, (bool, str)):
            raise ValueError(value)
        return query_quant_mode(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not supported; choose one of: {', '.join(QUERY_QUANT_MODES)} "
                          "(or true = both, false = none)", name) from None


# devices the runtime runs on: cpu, cuda, cuda:N (the kernels and CUDA graphs are CUDA-only; no mps)
_DEVICE_RE = re.compile(r"cpu|cuda(:[0-9]+)?")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


@dataclass
class KVCacheSpec:
    """Shape and format of the paged KV cache of one model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str = "bf16"
    page_size: int = 16
    # MLA keeps one latent "head" per token that serves as both K and V (no separate V plane).
    mla: bool = False
    # HND: a page holds [H_kv, page, D] (one head's tokens contiguous: longer runs per attention program,
    # measured faster for fp8 decode); NHD: [page, H_kv, D].  Planes are exposed as [P+1, page, H_kv, D]
    # either way.  One latent head (MLA) makes the two identical.
    layout: str = "HND"
    # one format per layer when layers differ (``kvbench.core.layer_formats``); None = kv_dtype everywhere.
    # ``kv_dtype`` stays the cache's main format (the one the run is named after).
    layer_dtypes: Optional[tuple] = None
    # layer groups over one page pool (``runtime/layer_groups.py``): sliding layers keep their window's pages
    # only; None = one page list for every layer
    groups: Optional["LayerGroups"] = None

    def __post_init__(self) -> None:
        _choice("kv_dtype", self.kv_dtype, format_names())
        if self.groups is not None and (self.mla or len(self.groups.group_of) != self.num_layers):
            raise ConfigError("layer groups need a group for every layer and no MLA latent")
        _choice("layout", self.layout, KV_LAYOUTS)
        for n in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            if int(getattr(self, n)) <= 0:
                raise ConfigError(f"{n} must be positive, got {getattr(self, n)}")
        if self.layer_dtypes is not None:
            self.layer_dtypes = tuple(self.layer_dtypes)
            if len(self.layer_dtypes) != self.num_layers:
                raise ConfigError(f"layer_dtypes has {len(self.layer_dtypes)} entries for {self.num_layers} layers")
            for f in self.layer_dtypes:
                _choice("layer_dtypes", f, format_names())
            if self.mla and len(set(self.layer_dtypes)) > 1:
                raise ConfigError("per-layer KV formats are not supported for MLA models (one latent format for every layer)")
            if all(f == self.kv_dtype for f in self.layer_dtypes):
                self.layer_dtypes = None
        for f in self.formats_used:
            err = get_spec(f).head_dim_error(self.head_dim)  # block size / packing of the format
            if err:
                raise ConfigError(err)

    @property
    def formats(self) -> tuple:
        """The format of every layer."""
        return self.layer_dtypes if self.layer_dtypes is not None else (self.kv_dtype,) * self.num_layers

    @property
    def formats_used(self) -> tuple:
        """The distinct formats of the cache, the main one first."""
        return tuple(dict.fromkeys((self.kv_dtype, *self.formats)))

    @property
    def mixed(self) -> bool:
        return self.layer_dtypes is not None

    @property
    def planes(self) -> int:
        """Number of cache planes per layer: K and V, or just the latent for MLA."""
        return 1 if self.mla else 2

    def group_of(self, layer: int) -> int:
        """The page list ``layer`` reads and writes (0 without layer groups)."""
        return 0 if self.groups is None else self.groups.group_of[layer]


@dataclass
class EngineConfig:
    """Everything that decides how the embedded engine runs (docs/design.md §11 flags map 1:1 onto fields)."""

    model: Optional[str] = None  # path, GGUF file, preset or synthetic shape; None = default model
    kv_dtype: str = "bf16"
    kv_scales: str = "unit"
    kv_scales_per_head: bool = False
    # layers kept in bf16 (``0,1,31``, ranges, ``sliding_window``) and other per-layer formats
    # (``0-3:fp8_e4m3;31:bf16``); canonical strings (``kvbench.core.layer_formats``), resolved at start-up
    kv_dtype_skip_layers: Optional[str] = None
    kv_layer_dtypes: Optional[str] = None
    prefill_backend: str = "torch"
    decode_backend: str = "torch"
    fused_append: bool = True
    # fp8 (e4m3) queries: "none" | "prefill" | "decode" | "both" (True/False accepted, stored as both/none);
    # prefill = every prefill/extend chunk, decode = decode steps (scored continuations count as decode)
    quantize_query: "bool | str" = "none"
    page_size: int = 16
    kv_layout: str = "HND"
    kv_budget_gb: Optional[float] = None
    mem_fraction: float = 0.85
    max_running: int = 64
    max_num_batched_tokens: int = 2048  # chunked-prefill token budget per step
    # decode rows ride in prefill steps (one token each, decode semantics) instead of waiting for them
    mixed_prefill: bool = False
    # launch each step before the last one's tokens reach the host (steps without scoring rows; runtime/step_outputs.py)
    overlap_schedule: bool = True
    max_model_len: Optional[int] = None  # None = the model's own context length
    device: Optional[str] = None  # None = cuda if available else cpu
    dtype: Optional[str] = None  # None = float32 on CPU, bfloat16 on GPU
    enforce_eager: bool = False
    gemm_library: str = "cublas"  # the library of the linear layers on a CUDA GPU (GEMM_LIBRARIES)
    seed: int = 0
    calibration_prompts: int = 16
    served_model_name: Optional[str] = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field's type and value (values may come from YAML or the command line); raises
        ``ConfigError`` naming the field."""
        for name in ("model", "served_model_name"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise ConfigError(f"{name} must be a non-empty string, got {v!r}", name)
        backends = backend_names()
        for name, allowed in (("kv_dtype", format_names()), ("kv_scales", KV_SCALE_POLICIES), ("prefill_backend", backends),
                              ("decode_backend", backends), ("kv_layout", KV_LAYOUTS)):
            _choice(name, getattr(self, name), allowed)
        if self.dtype is not None:
            _choice("dtype", self.dtype, COMPUTE_DTYPES)
        _choice("gemm_library", self.gemm_library, GEMM_LIBRARIES)
        if self.device is not None and (not isinstance(self.device, str) or not _DEVICE_RE.fullmatch(self.device)):
            raise ConfigError(f"device={self.device!r} is not supported; choose cpu, cuda or cuda:N", "device")
        self.quantize_query = normalize_quantize_query(self.quantize_query)
        for name, opt in KV_OPTIONS.items():  # the KV options: canonical values (kvbench.core.kv_config)
            if name == "quantize_query" or not hasattr(self, name):
                continue
            value = getattr(self, name)
            if opt.boolean and not isinstance(value, bool):
                raise ConfigError(f"{name} must be true or false, got {value!r}", name)
            try:
                setattr(self, name, opt.engine_value(opt.parse(value)))
            except ValueError as e:
                raise ConfigError(f"{name}: {e}", name) from None
        for name in ("enforce_eager", "mixed_prefill", "overlap_schedule"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}", name)
        for name, optional in (("page_size", False), ("max_running", False), ("max_num_batched_tokens", False),
                               ("max_model_len", True), ("calibration_prompts", False)):
            v = getattr(self, name)
            if optional and v is None:
                continue
            if not _is_int(v) or v <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}", name)
        if self.page_size & (self.page_size - 1):
            raise ConfigError(f"page_size must be a positive power of two, got {self.page_size}", "page_size")
        if not _is_int(self.seed):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}", "seed")
        if self.kv_budget_gb is not None and (not _is_num(self.kv_budget_gb) or self.kv_budget_gb <= 0):
            raise ConfigError(f"kv_budget_gb must be a positive number (GiB), got {self.kv_budget_gb!r}", "kv_budget_gb")
        if not _is_num(self.mem_fraction) or not 0 < self.mem_fraction <= 1:
            raise ConfigError(f"mem_fraction must be a number in (0, 1], got {self.mem_fraction!r}", "mem_fraction")
        if not isinstance(self.extra, dict):
            raise ConfigError(f"extra must be a mapping, got {self.extra!r}", "extra")

    @property
    def backend_label(self) -> str:
        if self.prefill_backend == self.decode_backend:
            return self.prefill_backend
        return f"{self.prefill_backend}+{self.decode_backend}"

    @property
    def kv(self) -> KVConfig:
        """The engine's KV configuration (options at their defaults are left out, as a sweep cell has them)."""
        opts = {n: getattr(self, n) for n, o in KV_OPTIONS.items()
                if hasattr(self, n) and o.parse(getattr(self, n)) not in (None, o.default)}
        return KVConfig.make(self.kv_dtype, self.kv_scales, opts, self.prefill_backend, self.decode_backend)

    def with_kv(self, kv: KVConfig) -> "EngineConfig":
        """This configuration with ``kv``'s format, scale policy, options (unset ones at their defaults) and
        the backends it names."""
        return replace(self, **{k: v for k, v in kv.engine_fields().items() if hasattr(self, k)})

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**d)


# ------------------------------------------------------------------------------ context length
def context_length(requested: Optional[int], model_max: int, model: str = "the model") -> int:
    """The engine's context length: ``max_model_len`` when given, else the model's own (its
    ``max_position_embeddings``).  A request above the model's own is refused, never cut down."""
    if requested is None:
        return int(model_max)
    if requested > model_max:
        raise ConfigError(
            f"--max-model-len (max_model_len) {requested} is above the longest context {model} supports: "
            f"{model_max} tokens (max_position_embeddings in its config); give at most {model_max}", "max_model_len")
    return int(requested)


def context_in_cache(max_len: int, cache_tokens: int, requested: Optional[int]) -> tuple[int, Optional[str]]:
    """(context length, a note or None): ``max_len`` cut to what the KV cache holds, with a note saying so
    (the engine logs it as a warning; the cut is never silent)."""
    if cache_tokens >= max_len:
        return max_len, None
    asked = f"--max-model-len {requested}" if requested is not None else f"the model's context of {max_len} tokens"
    return cache_tokens, (f"the KV cache holds {cache_tokens} tokens, fewer than {asked}: the context is "
                          f"{cache_tokens} tokens; raise --kv-budget-gb / --mem-fraction for a longer one")
