"""What a fidelity reference's cache key holds (suites/fidelity/cache.py): the reference model's identity
(core/model_identity.py) and the reference's settings that change its logits.

Embedded engine (``kvbench eval``, embedded sweep targets): the model's file identity (GGUF, HF directory,
hub snapshot; a synthetic model's shape and seed) and every ``EngineConfig`` field except those that only
schedule or size the run (``LOGITS_NEUTRAL``: concurrency, ``max_running``, chunked-prefill budget, KV
budget, context length, CUDA graphs, served name, seed); device and compute dtype are resolved first
(``device: null`` on a CPU machine is ``cpu``, ``dtype: null`` there is ``float32``; ``cuda:0`` and
``cuda:1`` are the same device type).  A field added to ``EngineConfig`` later is in the key until it is
listed here: a new setting can cost a recomputation, never a stale reference.

``kvbench eval --endpoint`` scores the candidate on the endpoint but computes its reference in the embedded
engine, so its key is the embedded one.  Sweep server and endpoint targets are their own reference: the
server is a black box, so the key holds what it reports and what started it:
the served model id, its ``/v1/models`` card (``root``, the model path, on vLLM), the launch command
rendered for the reference cell (port and devices left out), the target's environment (hashed), and the
identity of the cell's model when it names a file or directory on this machine.  Not covered: weights
changed behind the same served id and launch command on a machine this process cannot read (an endpoint's
remote disk, a server whose model path is not local): there, start a fresh run directory.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from kvbench.core.model_identity import model_identity

log = logging.getLogger(__name__)

# EngineConfig fields that change how a run is scheduled or sized, not what logits a request gets
LOGITS_NEUTRAL = frozenset({
    "model",  # replaced by the model's identity
    "max_running", "max_num_batched_tokens", "mixed_prefill", "overlap_schedule", "kv_budget_gb", "mem_fraction", "max_model_len",
    "enforce_eager", "served_model_name", "seed",  # the seed of a synthetic model is in its identity
    "device", "dtype",  # replaced by the resolved device type and compute dtype
})
CARD_KEYS = ("id", "root", "parent", "max_model_len", "owned_by")


@dataclass
class ReferenceKey:
    """The reference's model identity and logits-relevant settings (both go into the cache key; the
    model identity is also kept in the entry's meta, so a rebuild can say what changed)."""

    model: dict
    settings: dict

    def to_dict(self) -> dict:
        return asdict(self)


def local_model_identity(name: Optional[str], seed: int = 0) -> dict:
    """The identity of ``--model`` as the embedded engine resolves it (runtime/models/loader.py)."""
    from kvbench.runtime import is_hub_id

    kind, loc = _resolve(name)
    if not Path(loc).exists() and kind != "synthetic":  # the default model not fetched: nothing loaded it here
        return {"kind": kind, "path": loc, "absent": True}
    shape = None
    if kind == "synthetic":
        from kvbench.runtime import parse_synthetic

        shape = asdict(parse_synthetic(loc))
    return model_identity(kind, loc, seed=seed, shape=shape, hub_id=name if is_hub_id(name) else None)


def _resolve(name: Optional[str]) -> tuple[str, str]:
    """``resolve_model``, except that a preset (the default model) is never fetched just to be identified."""
    from kvbench.runtime import MODEL_PRESETS, preset_path, resolve_model

    if name is None or name in MODEL_PRESETS:
        return "gguf", str(preset_path(name))
    return resolve_model(name)


def engine_settings(cfg) -> dict:
    """The fields of EngineConfig ``cfg`` that change logits, device type and compute dtype resolved."""
    from kvbench.runtime import engine_device, engine_dtype

    d = {k: v for k, v in cfg.to_dict().items() if k not in LOGITS_NEUTRAL}
    if cfg.kv_scales != "calibrate":
        d.pop("calibration_prompts", None)
    dev = engine_device(cfg)
    d["device_type"] = dev.type
    d["compute_dtype"] = str(engine_dtype(cfg, dev)).replace("torch.", "")
    return d


def embedded_reference_key(cfg) -> ReferenceKey:
    """The key of an embedded reference engine of EngineConfig ``cfg``."""
    return ReferenceKey(local_model_identity(cfg.model, cfg.seed), engine_settings(cfg))


def served_model_card(base_url: str, model_id: str, api_key: Optional[str] = None, timeout: float = 10.0) -> dict:
    """The ``/v1/models`` card of ``model_id`` (``CARD_KEYS`` only: vLLM's ``created`` is the request time);
    {} when the server does not answer."""
    try:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        r = httpx.get(f"{base_url.rstrip('/')}/v1/models", headers=headers, timeout=timeout)
        cards = (r.json().get("data") or []) if r.status_code == 200 else []
    except Exception as e:  # provenance only: a server without the route is keyed by what else it reports
        log.debug("no /v1/models card from %s: %s", base_url, e)
        return {}
    card = next((c for c in cards if isinstance(c, dict) and c.get("id") == model_id), None)
    return {k: card[k] for k in CARD_KEYS if card and k in card}


def _local_path_identity(model: Optional[str]) -> Optional[dict]:
    """The file identity of a model string that names a GGUF file or a directory here (None otherwise)."""
    if not model:
        return None
    p = Path(model).expanduser()
    try:
        if p.is_file() and p.suffix == ".gguf":
            return model_identity("gguf", str(p))
        if p.is_dir() and (p / "config.json").is_file():
            return model_identity("hf", str(p))
        if p.is_dir() and len(ggufs := sorted(p.glob("*.gguf"))) == 1:
            return model_identity("gguf", str(ggufs[0]))
    except OSError:
        return None
    return None


def server_reference_key(target, cell_config: dict, model_id: str, base_url: Optional[str]) -> ReferenceKey:
    """The key of a reference on a server (``target.type == "server"``) or an endpoint: see the module doc."""
    launch = None
    if target.type == "server" and target.launch:
        from kvbench.harness.targets import render_launch

        try:
            launch = render_launch(target, cell_config, 0)  # port 0: the key must not change with the free port
        except Exception:  # a template this cell cannot fill: the template itself
            launch = target.launch
    env = sorted((target.env or {}).items())
    model = {"kind": target.type, "model": cell_config.get("model"), "model_id": model_id,
             "card": served_model_card(base_url, model_id, target.api_key) if base_url else {},
             "launch": launch, "env_sha256": hashlib.sha256(repr(env).encode()).hexdigest()[:16] if env else None,
             "local": _local_path_identity(cell_config.get("model"))}
    if target.type == "endpoint":
        model["url"] = target.base_url
    settings = {k: cell_config.get(k) for k in ("prefill_backend", "decode_backend", "kv_dtype", "kv_scales",
                                                "scales_file", "extra_args")}
    settings.update(extra_args_target=target.extra_args or None, kv_dtype_map=target.kv_dtype_map or None,
                    backend_map=target.backend_map or None)
    return ReferenceKey(model, settings)

