"""Engine start-up: device and dtype, backend check (before any weights load), model, KV budget and
capacity, KV scales per policy, cache, backend and runner."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Optional

import torch

from kvbench.core import get_spec
from kvbench.runtime.attention.base import BackendOptions
from kvbench.runtime.attention.registry import check_supported, create_backend
from kvbench.core import layer_dtypes_summary, resolve_layer_dtypes
from kvbench.runtime.config import ConfigError, EngineConfig, KVCacheSpec, context_in_cache, context_length
from kvbench.runtime.engine_api import CapacityReport
from kvbench.runtime.kv_cache import PagedKVCache, bytes_per_token, plan_capacity, windowed_capacity
from kvbench.runtime.models.loader import LoadedModel, load_model, model_is_mla
from kvbench.runtime.models.runner import ModelRunner
from kvbench.runtime.scales import KVScales, checkpoint_scales, unit_scales

if TYPE_CHECKING:
    from kvbench.runtime.layer_groups import LayerGroups

__all__ = ["EngineParts", "build_engine_parts", "CPU_DEFAULT_KV_GB", "engine_device", "engine_dtype", "kv_budget_bytes"]

log = logging.getLogger("kvbench.runtime")

CPU_DEFAULT_KV_GB = 1.0  # KV budget on CPU when neither --kv-budget-gb nor a GPU says otherwise


@dataclass
class EngineParts:
    device: torch.device
    dtype: torch.dtype
    loaded: LoadedModel
    cache: PagedKVCache
    runner: ModelRunner
    scales: KVScales
    capacity: CapacityReport
    max_model_len: int
    backend: Any
    q_scales: Any = None  # QueryScales (the fp8 query's dequant multiplier per layer and its source)
    page_window: Optional[int] = None  # windowed pages: the scheduler frees pages below it (window_pages)


def engine_device(cfg: EngineConfig) -> torch.device:
    """The engine's device; a ``ValueError`` (one line for the command line) for a device string torch does
    not parse, a device type the runtime does not run on, or a CUDA device this machine does not have."""
    if cfg.device:
        try:
            dev = torch.device(cfg.device)
        except (RuntimeError, TypeError, ValueError) as e:
            raise ValueError(f"device {cfg.device!r} is not a device; use cpu, cuda or cuda:N ({e})") from None
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device {cfg.device!r} is not supported; use cpu, cuda or cuda:N")
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("device cuda requested but no CUDA device is available")
            n = torch.cuda.device_count()
            if dev.index is not None and dev.index >= n:
                raise ValueError(f"device {cfg.device} requested but this machine has {n} CUDA device(s) (cuda:0..cuda:{n - 1})")
        return dev
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def engine_dtype(cfg: EngineConfig, device: torch.device) -> torch.dtype:
    """The compute dtype: ``cfg.dtype``, else bfloat16 on CUDA and float32 on the CPU."""
    return getattr(torch, cfg.dtype) if cfg.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)


def kv_budget_bytes(cfg: EngineConfig, device: torch.device, loaded: LoadedModel) -> float:
    """The KV cache's budget in bytes: ``kv_budget_gb``, else the CPU default, else the GPU's free memory times
    ``mem_fraction`` less the activations of one step."""
    if cfg.kv_budget_gb is not None:
        return cfg.kv_budget_gb * 2**30
    if device.type != "cuda":
        return CPU_DEFAULT_KV_GB * 2**30
    torch.cuda.synchronize(device)
    free, _total = torch.cuda.mem_get_info(device)
    m = loaded.config
    # activations of one chunked-prefill step plus sampling rows (generous, in bytes)
    act = cfg.max_num_batched_tokens * (3 * m.intermediate_size + 6 * m.hidden_size) * 4
    act += cfg.max_running * m.vocab_size * 4 * 3 + 512 * 2**20
    if m.is_mla and get_spec(cfg.kv_dtype).quantized:  # the MLA prefill's prefix workspace (kernels/mla_prefill.py)
        from kvbench.kernels import WORKSPACE_BYTES

        act += WORKSPACE_BYTES
    elif not m.is_mla and (get_spec(cfg.kv_dtype).quantized or cfg.kv_layer_dtypes):
        # the extend's float16 prefix workspace over a quantized cache (kernels/prefill.py; a layer map may hold
        # quantized layers over a 16-bit default)
        from kvbench.kernels import WORKSPACE_CAP_BYTES

        act += WORKSPACE_CAP_BYTES
    return max(free * cfg.mem_fraction - act, 64 * 2**20)


def _layer_dtypes(cfg: EngineConfig, m) -> Optional[list[str]]:
    """One format per layer when the config keeps some layers in another format, else None; a layer the
    model does not have, or a pattern no layer matches, is a ``ConfigError`` naming the option."""
    if not cfg.kv_dtype_skip_layers and not cfg.kv_layer_dtypes:
        return None
    try:
        out = resolve_layer_dtypes(cfg.kv_dtype, m.num_layers, cfg.kv_dtype_skip_layers, cfg.kv_layer_dtypes, m.sliding_windows)
    except ValueError as e:
        raise ConfigError(str(e), "kv_layer_dtypes" if "kv_layer_dtypes" in str(e) else "kv_dtype_skip_layers") from None
    if m.is_mla and len(set(out)) > 1:
        raise ConfigError("per-layer KV formats are not supported for MLA models (one latent format for every layer)",
                          "kv_dtype_skip_layers")
    return out


def _scales(cfg: EngineConfig, loaded: LoadedModel, rope, device: torch.device, layer_dtypes=None) -> KVScales:
    L = loaded.config.num_layers
    if cfg.kv_scales == "unit":
        return unit_scales(cfg.kv_dtype, L)
    if cfg.kv_scales == "checkpoint":
        sc = loaded.scales
        if loaded.config.is_mla:  # one latent scale per layer (k_scale), used as K and V scale
            return checkpoint_scales({i: (sc.k[i], sc.k[i]) for i in range(L)}, L)
        return checkpoint_scales({i: (sc.k[i], sc.v[i]) for i in range(L)}, L)
    from kvbench.runtime.models.calibration import calibrate_scales

    return calibrate_scales(
        loaded.model, loaded.tokenizer, rope, cfg.kv_dtype, cfg.calibration_prompts, cfg.kv_scales_per_head, device,
        layer_dtypes=layer_dtypes,
    )


@dataclass
class QueryScales:
    """Dequant multiplier of the fp8 query per layer (``quantize_query``) and where it came from:
    ``checkpoint`` (every layer has ``...self_attn[.attn].q_scale`` or ``q_proj.output_scale``),
    ``checkpoint+unit`` (some layers; the rest 1.0) or ``unit`` (none: 1.0, what vLLM and SGLang use
    when a checkpoint gives no query scale)."""

    values: list[float]
    source: str

    def summary(self) -> dict:
        return {"source": self.source, "min": min(self.values, default=1.0), "max": max(self.values, default=1.0)}


def query_scales(loaded: LoadedModel) -> QueryScales:
    """The query scales of a loaded model (``loaded.scales.q``; per-tensor: a vector keeps its maximum)."""
    import math

    L = loaded.config.num_layers
    found = list(getattr(loaded.scales, "q", None) or [None] * L)
    vals = []
    for i in range(L):
        t = found[i] if i < len(found) else None
        if t is None:
            vals.append(1.0)
            continue
        v = float(torch.as_tensor(t, dtype=torch.float32).max())
        if not math.isfinite(v) or v <= 0:
            raise ValueError(f"the checkpoint's q_scale of layer {i} must be finite and positive, got {v}")
        vals.append(v)
    n = sum(t is not None for t in found[:L])
    return QueryScales(vals, "unit" if n == 0 else "checkpoint" if n == L else "checkpoint+unit")


def _refuse_head_dim(cfg: EngineConfig, m, mla: bool, device: torch.device, layer_dtypes, model_id: str) -> None:
    """Backend and head size pairs no kernel runs, refused before the backends load (``ConfigError``)."""
    if cfg.prefill_backend == "flashinfer" and not mla and m.head_dim not in FLASHINFER_PREFILL_HEAD_DIMS:
        raise ConfigError(f"flashinfer's prefill kernels take head_dim {', '.join(map(str, FLASHINFER_PREFILL_HEAD_DIMS))}; "
                          f"{model_id} has head_dim {m.head_dim}: use --prefill-backend triton or torch (flashinfer "
                          "decode still applies)", "prefill_backend")
    if (device.type == "cuda" and not mla and m.head_dim < 32 and "triton" in (cfg.prefill_backend, cfg.decode_backend)
            and "nvfp4" in (layer_dtypes or (cfg.kv_dtype,))):
        # the kernels split an nvfp4 head into its even and odd halves, and a tensor-core dot needs 16 of each
        raise ConfigError(f"the triton backend reads an nvfp4 cache on the GPU at head_dim >= 32; {model_id} "
                          f"has head_dim {m.head_dim}: use the torch backend or another kv_dtype", "kv_dtype")


def _attach_graphs(runner: ModelRunner, cfg: EngineConfig, backend, device: torch.device, max_len: int) -> None:
    """Decode CUDA graphs on a GPU (unless eager), and the buffer steps launched ahead read their ids from."""
    if device.type == "cuda" and not cfg.enforce_eager:
        from kvbench.runtime.graphs import DecodeGraphs, graph_safe

        if graph_safe(backend):  # with layer groups too: the graphs stage every group's table and slots
            runner.graphs = DecodeGraphs(runner, max_batch=cfg.max_running, max_model_len=max_len)
        else:
            log.warning("decode backend %s is not CUDA-graph capturable; decoding eagerly", cfg.decode_backend)
    if cfg.overlap_schedule:  # steps launched ahead read the previous step's tokens from here (runtime/step_outputs.py)
        if runner.graphs is not None:
            runner.graphs.copy_outside = True
            runner.fed = runner.graphs.fed
        else:
            runner.fed = torch.zeros(cfg.max_running, dtype=torch.int64, device=device)


def build_engine_parts(cfg: EngineConfig, loaded: LoadedModel | None = None, scales: Optional[KVScales] = None) -> EngineParts:
    """``loaded``: reuse an already loaded model (tests, sweeps over KV formats) instead of loading ``cfg.model``;
    ``scales``: use these KV scales instead of the policy's (a diagnosis builds many engines on one calibration)."""
    device = engine_device(cfg)
    dtype = engine_dtype(cfg, device)
    # fail before loading weights (MLA models run on fewer backends)
    mla = loaded.config.is_mla if loaded is not None else model_is_mla(cfg.model)
    check_supported(cfg.prefill_backend, cfg.decode_backend, cfg.kv_dtype, mla)
    if loaded is None:
        loaded = load_model(cfg.model, device=device, dtype=dtype, seed=cfg.seed)
    elif next(loaded.model.parameters()).device.type != device.type:
        raise ValueError(f"pre-loaded model is on {next(loaded.model.parameters()).device}, engine device is {device}")
    m = loaded.config
    layer_dtypes = _layer_dtypes(cfg, m)
    _refuse_head_dim(cfg, m, mla, device, layer_dtypes, loaded.model_id)
    for f in dict.fromkeys(layer_dtypes or ()):  # every format of a mixed cache runs on both backends
        check_supported(cfg.prefill_backend, cfg.decode_backend, f, mla)
    max_len = context_length(cfg.max_model_len, m.max_position_embeddings, loaded.model_id)
    rope = m.rope_cache(max(max_len, 1), device)  # with the local layers' tables where they differ (Gemma 3)
    spec: KVCacheSpec = m.kv_spec(cfg.kv_dtype, cfg.page_size, cfg.kv_layout)
    if layer_dtypes is not None:
        spec = replace(spec, layer_dtypes=tuple(layer_dtypes))
    groups = layer_groups_for(cfg, m, spec.formats)
    if groups is not None:
        spec = replace(spec, groups=groups)
    if scales is None:
        scales = _scales(cfg, loaded, rope, device, layer_dtypes)
    budget = kv_budget_bytes(cfg, device, loaded)
    plan = plan_capacity(spec, budget, max(max_len, 1))
    if plan.num_pages < 1:
        raise ValueError(f"KV budget {budget / 2**30:.3f} GiB holds no page of {cfg.page_size} tokens ({bytes_per_token(spec):.0f} B/token)")
    max_len, note = context_in_cache(max_len, plan.tokens, cfg.max_model_len)
    if note:
        log.warning(note)
    plan = plan_capacity(spec, plan.num_pages * cfg.page_size * plan.bytes_per_token, max_len)
    cache = PagedKVCache(spec, plan.num_pages, device=device)
    # MLA: one latent plane whose k_scale serves as K and V scale
    cache.set_scales(scales.k, None if spec.mla else scales.v)
    opts = BackendOptions(
        kv_dtype=cfg.kv_dtype, fused_append=cfg.fused_append, quantize_query=cfg.quantize_query,
        device=str(device), dtype=str(dtype).replace("torch.", ""), max_batch_size=cfg.max_running, extra=dict(cfg.extra),
    )
    backend = create_backend(cfg.prefill_backend, cfg.decode_backend, opts, mla=spec.mla)
    q_scales = query_scales(loaded)
    for layer, qs in zip(loaded.model.attention_layers, q_scales.values):
        layer.q_scale = qs  # set every time: a shared loaded model gets the same values
    runner = ModelRunner(loaded.model, cache, backend, rope, device)
    _attach_graphs(runner, cfg, backend, device, max_len)
    capacity = CapacityReport(
        kv_dtype=cfg.kv_dtype, page_size=cfg.page_size, num_pages=plan.num_pages, tokens=plan.tokens,
        bytes_per_token=plan.bytes_per_token, kv_bytes=plan.kv_bytes, context_len=max_len,
        max_concurrency=plan.max_concurrency,
        extra={"kv_budget_bytes": int(budget), "kv_scales": scales.source, "model": loaded.model_id,
               "quantize_query": cfg.quantize_query, "q_scale_source": q_scales.source},
    )
    page_window = window_pages(cfg, m, plan.num_pages)
    if not spec.mla and any(w is not None for w in m.sliding_windows):
        # what the budget holds with sliding layers at their window's pages: what this engine gets when every
        # layer slides (page_window), else what an engine with a page table per layer group would
        capacity.extra.update(windowed_capacity(replace(spec, groups=None), m.sliding_windows, budget, max_len),
                              windowed_pages=page_window is not None or spec.groups is not None)
    if spec.groups is not None:
        capacity.extra.update(layer_groups=spec.groups.num_groups, layers_per_group=spec.groups.size)
    if spec.mixed:  # the capacity above is exact: bytes_per_token sums every layer in its own format
        capacity.extra.update(
            kv_dtype_skip_layers=cfg.kv_dtype_skip_layers, kv_layer_dtypes=cfg.kv_layer_dtypes,
            layer_formats={f: spec.formats.count(f) for f in spec.formats_used},
            kv_layers=layer_dtypes_summary(spec.formats, cfg.kv_dtype),
        )
    return EngineParts(device, dtype, loaded, cache, runner, scales, capacity, max_len, backend, q_scales, page_window)


# the head sizes flashinfer's paged prefill compiles for (its Hopper kernels assert them; the decode kernels take more)
FLASHINFER_PREFILL_HEAD_DIMS = (64, 128, 256)

# backends whose kernels never look up a page below a sequence's window (runtime/scheduler.py, windowed pages)
WINDOW_SAFE_BACKENDS = ("torch", "triton")


def layer_groups_for(cfg: EngineConfig, m, formats) -> Optional["LayerGroups"]:
    """Layer groups over one page pool for a model with global and sliding layers (``runtime/layer_groups.py``):
    on for Gemma 3, for any such model with ``extra={"layer_group_pages": True}``, off with ``False``; only on
    backends that never read below a window, and where the layers sharing a plane slot share a format."""
    from kvbench.runtime.layer_groups import plan_layer_groups

    want = (cfg.extra or {}).get("layer_group_pages", "auto")
    if want not in (True, False, "auto"):
        raise ConfigError(f"extra.layer_group_pages must be true, false or auto, got {want!r}", "extra")
    if want is False or (want == "auto" and m.arch != "gemma3") or m.is_mla:
        return None
    if cfg.prefill_backend not in WINDOW_SAFE_BACKENDS or cfg.decode_backend not in WINDOW_SAFE_BACKENDS:
        return None
    return plan_layer_groups(m.sliding_windows, formats)


def window_pages(cfg: EngineConfig, m, num_pages: int) -> Optional[int]:
    """The window below which the scheduler frees pages: the largest window when every layer of the model has
    one, both backends never read below a window and the pool holds a window and a full chunk; None (every page
    kept) otherwise.  A model with global layers keeps them all: one page table serves every layer
    (docs/design.md §5)."""
    wins = m.sliding_windows
    if m.is_mla or not wins or any(w is None for w in wins):
        return None
    if cfg.prefill_backend not in WINDOW_SAFE_BACKENDS or cfg.decode_backend not in WINDOW_SAFE_BACKENDS:
        return None
    w = int(max(wins))
    return w if num_pages >= -(-(w + cfg.max_num_batched_tokens) // cfg.page_size) + 1 else None
