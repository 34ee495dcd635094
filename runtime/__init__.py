"""kvbench.runtime: the embedded inference engine (models, paged KV cache in every format, attention backends,
scheduler, CUDA graphs, the OpenAI-compatible server).  Entry point: the names below (docs/architecture.md)."""

# The package's entry point: the names other packages use, each from the module that defines it, imported
# when first asked for (kvbench.core.lazy_exports), so importing the package costs nothing.
from kvbench.core.lazy import lazy_exports

_EXPORTS = {
    "backend_class": "attention.registry",
    "ConfigError": "config",
    "EngineConfig": "config",
    "context_length": "config",
    "KLMeter": "diagnostics_meter",
    "REF_CACHE_BYTES": "diagnostics_meter",
    "TextIds": "diagnostics_meter",
    "capacity_basis": "diagnostics_meter",
    "capacity_rows": "diagnostics_meter",
    "load_for": "diagnostics_meter",
    "Engine": "engine",
    "bytes_per_token": "kv_cache",
    "plan_capacity": "kv_cache",
    "windowed_capacity": "kv_cache",
    "SHAPES": "model_shapes",
    "get_shape": "model_shapes",
    "load_shape": "model_shapes",
    "shard_shape": "model_shapes",
    "engine_device": "models.engine_setup",
    "engine_dtype": "models.engine_setup",
    "from_hf_config": "models.hf_config",
    "HUB_ID": "models.hub",
    "cached_snapshot": "models.hub",
    "hub_offline": "models.hub",
    "is_hub_id": "models.hub",
    "local_copy_hint": "models.hub",
    "MODEL_PRESETS": "models.loader",
    "preset_path": "packaged_models",
    "load_model": "models.loader",
    "resolve_model": "models.loader",
    "StepInputs": "models.runner",
    "SYNTHETIC_PRESETS": "models.synthetic",
    "parse_synthetic": "models.synthetic",
    "MAX_SCORE_LOGPROBS": "sampling",
    "ScheduledBatch": "scheduler",
    "Sequence": "scheduler",
    "create_app": "server",
    "run_server": "server",
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
