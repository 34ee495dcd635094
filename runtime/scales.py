"""KV scale policies: ``unit``, ``checkpoint``, ``calibrate`` (docs/design.md §4).

A policy yields ``KVScales``: fp32 dequant multipliers ``k``/``v`` of shape ``[num_layers]`` (per layer) or
``[num_layers, H_kv]`` (per kv-head).  ``PagedKVCache.set_scales`` copies them to the device in place.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import torch

from kvbench.core import get_spec
from kvbench.kernels import get_format, scale_from_amax

log = logging.getLogger("kvbench.scales")

__all__ = ["KVScales", "UnitScaleWarning", "unit_scales", "checkpoint_scales", "AmaxObserver"]


class UnitScaleWarning(UserWarning):
    """fp8/nvfp4 KV with unit scales: the main cause of reported fp8 accuracy drops."""


@dataclass
class KVScales:
    k: torch.Tensor
    v: torch.Tensor
    source: str  # "unit" | "checkpoint" | "calibrate"
    per_head: bool = False
    details: dict = field(default_factory=dict)

    def summary(self) -> dict:
        """Small JSON-able description for provenance and reports."""
        return {
            "source": self.source,
            "per_head": self.per_head,
            "k_min": float(self.k.min()),
            "k_max": float(self.k.max()),
            "v_min": float(self.v.min()),
            "v_max": float(self.v.max()),
            **self.details,
        }


def unit_scales(kv_dtype: str, num_layers: int) -> KVScales:
    if get_spec(kv_dtype).tensor_scale:  # a format whose scales are all stored per token needs none
        msg = (
            f"KV format {kv_dtype} with unit scales: values outside the format's range saturate and small "
            "ones lose precision; use --kv-scales calibrate (or checkpoint) for a fair accuracy comparison"
        )
        warnings.warn(msg, UnitScaleWarning, stacklevel=2)
        log.warning(msg)
    ones = torch.ones(num_layers, dtype=torch.float32)
    return KVScales(ones, ones.clone(), "unit")


def checkpoint_scales(tensors: Mapping[int, tuple[Optional[torch.Tensor], Optional[torch.Tensor]]], num_layers: int) -> KVScales:
    """Scales read from a checkpoint: ``{layer: (k_scale, v_scale)}`` (scalars or per-head vectors).

    A checkpoint without scales for some layer is an error: silently using 1.0 would hide the problem.
    """
    missing = [i for i in range(num_layers) if i not in tensors or tensors[i][0] is None or tensors[i][1] is None]
    if missing:
        raise ValueError(
            f"--kv-scales checkpoint: the checkpoint has no k_scale/v_scale for layers {missing[:8]}"
            f"{'...' if len(missing) > 8 else ''}; use --kv-scales calibrate or unit"
        )
    ks = [torch.as_tensor(tensors[i][0], dtype=torch.float32).flatten() for i in range(num_layers)]
    vs = [torch.as_tensor(tensors[i][1], dtype=torch.float32).flatten() for i in range(num_layers)]
    per_head = any(t.numel() > 1 for t in ks + vs)
    if per_head:
        width = max(t.numel() for t in ks + vs)
        ks = [t.expand(width) if t.numel() == 1 else t for t in ks]
        vs = [t.expand(width) if t.numel() == 1 else t for t in vs]
        k, v = torch.stack(ks), torch.stack(vs)
    else:
        k, v = torch.cat(ks), torch.cat(vs)
    if not (torch.isfinite(k).all() and torch.isfinite(v).all() and (k > 0).all() and (v > 0).all()):
        raise ValueError("--kv-scales checkpoint: the checkpoint's KV scales must be finite and positive")
    return KVScales(k, v, "checkpoint", per_head)


class AmaxObserver:
    """Collects per-layer (and per-head) absolute maxima of post-RoPE K and of V during bf16 runs."""

    def __init__(self, num_layers: int, num_kv_heads: int):
        self.k_amax = torch.zeros(num_layers, num_kv_heads, dtype=torch.float32)
        self.v_amax = torch.zeros(num_layers, num_kv_heads, dtype=torch.float32)
        self.tokens = 0

    def observe(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """``k``/``v``: ``[T, H_kv, D]`` exactly as they would be stored (after RoPE)."""
        ka = k.detach().abs().float().amax(dim=(0, 2)).cpu()
        va = v.detach().abs().float().amax(dim=(0, 2)).cpu()
        torch.maximum(self.k_amax[layer], ka, out=self.k_amax[layer])
        torch.maximum(self.v_amax[layer], va, out=self.v_amax[layer])
        if layer == 0:
            self.tokens += k.shape[0]

    def describe(self, max_groups: int = 4) -> str:
        """The amax found, per group of consecutive layers (at most ``max_groups`` groups):
        ``"layers 0–7 amax K 12.3 V 4.5, layers 8–15 amax K 9.1 V 3.2"``."""
        n = self.k_amax.shape[0]
        if n == 0:
            return "no layers"
        size = -(-n // max(1, max_groups))
        parts = []
        for lo in range(0, n, size):
            hi = min(lo + size, n) - 1
            k, v = float(self.k_amax[lo : hi + 1].max()), float(self.v_amax[lo : hi + 1].max())
            which = f"layer {lo}" if lo == hi else f"layers {lo}\u2013{hi}"
            parts.append(f"{which} amax K {_short(k)} V {_short(v)}")
        return ", ".join(parts)

    def scales(self, kv_dtype: str, per_head: bool = False, layer_dtypes: Optional[Sequence[str]] = None) -> KVScales:
        """Scales from the observed amax in ``kv_dtype``, or per layer in ``layer_dtypes[layer]`` (a cache whose
        layers differ in format)."""
        if self.tokens == 0:
            raise RuntimeError("calibration observed no tokens; give calibration prompts")
        k_amax = self.k_amax if per_head else self.k_amax.amax(dim=1)
        v_amax = self.v_amax if per_head else self.v_amax.amax(dim=1)
        if layer_dtypes is None:
            fmt = get_format(kv_dtype)
            k, v = scale_from_amax(fmt, k_amax), scale_from_amax(fmt, v_amax)
        else:
            if len(layer_dtypes) != k_amax.shape[0]:
                raise ValueError(f"layer_dtypes has {len(layer_dtypes)} entries for {k_amax.shape[0]} layers")
            k = torch.stack([scale_from_amax(get_format(f), k_amax[i]) for i, f in enumerate(layer_dtypes)])
            v = torch.stack([scale_from_amax(get_format(f), v_amax[i]) for i, f in enumerate(layer_dtypes)])
        return KVScales(
            k, v, "calibrate", per_head,
            {"calibration_tokens": self.tokens, "k_amax_max": float(self.k_amax.max()), "v_amax_max": float(self.v_amax.max())},
        )


def _short(x: float) -> str:
    """A magnitude in about three significant digits (``12.3``, ``0.0412``, ``1.2e+04``)."""
    return f"{x:.3g}" if x >= 1e-3 or x == 0 else f"{x:.2e}"
