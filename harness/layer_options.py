"""Mixed per-layer KV formats where the harness meets them: the two options (``kv_dtype_skip_layers``,
``kv_layer_dtypes``) as a sweep's KV entries, the engine flags and server launches carry them.

* canonical values and labels of both options: ``kvbench.core.kv_config`` (``kv_option(name).parse``), so
  ``[31, 0, 1]``, ``"0,1,31"`` and ``"1,0,31"`` are one value (and one cell key).
* :func:`model_layers` -- a model's layer count and sliding windows when they are cheap to know before
  anything loads (``synthetic:`` names, a local Hugging Face directory); None otherwise (the engine checks
  the layers when it starts).
* :func:`check_model_layers` -- an option naming a layer the model does not have, or a pattern that matches
  none of its layers, is a ``ValueError`` saying which.
* :func:`vllm_skip_words` -- a skip set as vLLM's ``--kv-cache-dtype-skip-layers`` takes it (one word per
  layer index or pattern, no ranges).

No torch here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from kvbench.core import list_valued_options
from kvbench.core import parse_layer_set, resolve_layer_dtypes

__all__ = ["LAYER_OPTIONS", "model_layers", "check_model_layers", "check_model_layers_overlap", "vllm_skip_words"]

LAYER_OPTIONS = list_valued_options()  # kv_dtype_skip_layers, kv_layer_dtypes


def model_layers(ref: Optional[str]) -> Optional[tuple[int, list]]:
    """``(num_layers, sliding_windows)`` of ``--model ref`` when known without loading anything: a
    ``synthetic:`` name, or a local directory holding a ``config.json`` of an architecture the engine runs.
    None for the default model, presets, hub ids, GGUF files and anything that cannot be read."""
    cfg = _model_config(ref)
    if cfg is None:
        return None
    return int(cfg.num_layers), list(cfg.sliding_windows or [None] * cfg.num_layers)


def _model_config(ref: Optional[str]):
    """The ``ModelConfig`` of ``ref`` when it can be read without loading anything (see ``model_layers``)."""
    if not ref:
        return None
    try:
        if ref.startswith("synthetic:"):
            from kvbench.runtime import parse_synthetic

            cfg = parse_synthetic(ref)
        else:
            p = Path(ref).expanduser()
            f = p / "config.json"
            if not (p.is_dir() and f.is_file()):
                return None
            from kvbench.runtime import from_hf_config

            raw = json.loads(f.read_text(encoding="utf-8"))
            if not isinstance(raw, dict):
                return None
            cfg = from_hf_config(raw)
    except (ValueError, KeyError, TypeError, OSError):  # the engine reports these when it loads the model
        return None
    return cfg


def check_model_layers(ref: Optional[str], kv_dtype: str, skip_layers: Optional[str] = None,
                       layer_dtypes: Optional[str] = None) -> Optional[list[str]]:
    """The per-layer formats of model ``ref`` (None when its layers are not known yet, or nothing is
    mixed); ``ValueError`` naming the option when a layer or pattern does not fit the model, e.g.
    ``kv_dtype_skip_layers: layer 40 is not a layer of synthetic:llama-3-8b,layers=4 (it has 4: 0..3)``."""
    if not skip_layers and not layer_dtypes:
        return None
    cfg = _model_config(ref)
    if cfg is None:
        return None
    try:
        formats = resolve_layer_dtypes(kv_dtype, cfg.num_layers, skip_layers, layer_dtypes, cfg.sliding_windows or None)
    except ValueError as e:
        raise ValueError(str(e).replace("this model", ref)) from None
    if cfg.is_mla and len(set(formats)) > 1:
        raise ValueError(f"{ref} is an MLA model: its latent cache has one format for every layer (no "
                         "kv_dtype_skip_layers / kv_layer_dtypes)")
    return formats


def check_model_layers_overlap(skip_layers: Optional[str], layer_dtypes: Optional[str]) -> None:
    """A layer index named both in the skip set and in ``kv_layer_dtypes`` is a ``ValueError`` (any model)."""
    skipped = set(parse_layer_set(skip_layers)[0])
    for group in (layer_dtypes or "").split(";"):
        layers, _, _fmt = group.rpartition(":")
        both = sorted(skipped & set(parse_layer_set(layers)[0]))
        if both:
            raise ValueError(f"layer {both[0]} is in kv_dtype_skip_layers and kv_layer_dtypes; give it once")


def vllm_skip_words(skip_layers: Optional[str]) -> list[str]:
    """A skip set as vLLM's ``--kv-cache-dtype-skip-layers`` (``nargs="+"``) takes it: each layer index on its
    own (ranges expanded), then the patterns (``sliding_window``).  vLLM has no ``full_attention`` pattern:
    that is a ``ValueError``."""
    idx, pats = parse_layer_set(skip_layers)
    if "full_attention" in pats:
        raise ValueError("vLLM's --kv-cache-dtype-skip-layers takes layer indices and sliding_window, not "
                         "full_attention; list the layers instead")
    return [str(i) for i in idx] + list(pats)
