"""The attention backend table: which backend runs which KV format in which phase (docs/design.md §6).

Declarative and torch-free: config validation, the CLI and `kvbench formats` read it without importing
a kernel.  The runtime's attention registry (``kvbench.runtime.attention.registry``) attaches an
implementation to each name and checks every engine's (backend, format, phase) with ``assert_supported``.

``formats=None`` means every registered format (the torch reference backend, which runs any format
through its numerics); a tuple lists the formats the backend's kernels implement.  ``phase_formats``
narrows one phase further (flashinfer prefill reads bf16/fp16 caches only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvbench.core.formats import BUILTIN_FORMATS, format_names, get_spec

__all__ = [
    "PHASES",
    "BackendSpec",
    "BACKEND_SPECS",
    "register_backend",
    "backend_names",
    "get_backend_spec",
    "supported_formats",
    "is_supported",
    "assert_supported",
    "add_backend_formats",
]

PHASES = ("prefill", "decode")


@dataclass(frozen=True)
class BackendSpec:
    name: str
    phases: tuple[str, ...] = PHASES
    formats: Optional[tuple[str, ...]] = None
    needs: str = ""  # "" | "cuda" | "cuda+flashinfer": what the machine must have
    description: str = ""
    # per-phase narrowing: ((phase, formats), ...); a phase not named here uses ``formats``
    phase_formats: tuple[tuple[str, tuple[str, ...]], ...] = ()
    mla: bool = False  # runs MLA (latent-cache) models, with the same formats
    # the implementation, "module:Class" inside the runtime's attention package (runtime/attention/registry.py
    # imports it when the engine builds the backend; core names it and imports nothing); "" = none yet
    impl: str = ""

    def __post_init__(self) -> None:
        bad = [p for p in self.phases if p not in PHASES]
        if bad:
            raise ValueError(f"backend {self.name}: unknown phase(s) {bad}; known: {', '.join(PHASES)}")

    def formats_for(self, phase: str) -> tuple[str, ...]:
        """The registered formats this backend runs in ``phase`` (table order)."""
        if phase not in self.phases:
            return ()
        allowed = dict(self.phase_formats).get(phase, self.formats)
        names = format_names()
        return names if allowed is None else tuple(n for n in names if n in allowed)


BACKEND_SPECS: dict[str, BackendSpec] = {}


def register_backend(spec: BackendSpec) -> BackendSpec:
    if spec.name in BACKEND_SPECS:
        raise ValueError(f"attention backend {spec.name!r} is already registered")
    BACKEND_SPECS[spec.name] = spec
    return spec


def backend_names() -> tuple[str, ...]:
    return tuple(BACKEND_SPECS)


def get_backend_spec(name: str) -> BackendSpec:
    try:
        return BACKEND_SPECS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKEND_SPECS)}") from None


def supported_formats(backend: str, phase: Optional[str] = None, mla: bool = False) -> tuple[str, ...]:
    """Formats ``backend`` runs in ``phase`` (None: in every phase it has) — of MLA models with ``mla``."""
    spec = get_backend_spec(backend)
    if mla and not spec.mla:
        return ()
    phases = spec.phases if phase is None else (phase,)
    per = [set(spec.formats_for(p)) for p in phases]
    common = set.intersection(*per) if per else set()
    return tuple(n for n in format_names() if n in common)


def is_supported(backend: str, kv_dtype: str, phase: str, mla: bool = False) -> bool:
    if backend not in BACKEND_SPECS:
        return False
    return kv_dtype in supported_formats(backend, phase, mla)


def assert_supported(backend: str, kv_dtype: str, phase: str, mla: bool = False) -> None:
    """Raise ValueError naming the backend, the format and what the backend supports in ``phase``."""
    get_backend_spec(backend)
    get_spec(kv_dtype)
    if is_supported(backend, kv_dtype, phase, mla):
        return
    what = "MLA models with " if mla else ""
    ok = supported_formats(backend, phase, mla)
    raise ValueError(
        f"the {backend} backend does not support {what}kv format {kv_dtype} for {phase} "
        f"(supported: {', '.join(ok) or 'none'})"
    )


def add_backend_formats(backend: str, *names: str) -> BackendSpec:
    """Let ``backend`` run more formats (a format added together with its kernels for that backend).
    A backend that already runs every format (``formats=None``) is left as is."""
    spec = get_backend_spec(backend)
    if spec.formats is None:
        return spec
    extra = tuple(n for n in names if n not in spec.formats)
    pf = tuple((p, fs + tuple(n for n in names if n not in fs)) for p, fs in spec.phase_formats)
    new = BackendSpec(spec.name, spec.phases, spec.formats + extra, spec.needs, spec.description, pf, spec.mla)
    BACKEND_SPECS[backend] = new
    return new


# ------------------------------------------------------------------------------ built-in backends
register_backend(BackendSpec(
    "torch", formats=None, mla=True, impl="torch_backend:TorchBackend",
    description="reference: gather pages, dequantize, SDPA; any registered format; runs on CPU",
))
register_backend(BackendSpec(
    "triton", formats=BUILTIN_FORMATS, mla=True, needs="", impl="triton_backend:TritonBackend",
    description="Triton kernels: fused append, split-K decode, prefill over a quantized prefix",
))
register_backend(BackendSpec(
    "flashinfer", formats=("bf16", "fp16", "fp8_e4m3", "fp8_e5m2"), needs="cuda+flashinfer",
    impl="flashinfer_backend:FlashInferBackend",
    phase_formats=(("prefill", ("bf16", "fp16")),),
    description="FlashInfer paged kernels (GPU); no nvfp4, no sinks, no MLA",
))
