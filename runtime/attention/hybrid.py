"""Hybrid backend: one backend for prefill steps, another for decode steps (``--prefill-backend`` /
``--decode-backend``).  Both write the same cache layout, so a sequence prefilled by one is decoded by
the other."""

from __future__ import annotations

from typing import ClassVar

from kvbench.runtime.attention.base import AttentionBackend, AttentionLayer, AttentionMetadata

__all__ = ["HybridBackend"]


class HybridBackend:
    name: ClassVar[str] = "hybrid"

    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend):
        self.prefill = prefill
        self.decode = decode
        self.label = f"{prefill.name}+{decode.name}"

    def _pick(self, meta: AttentionMetadata) -> AttentionBackend:
        return self.decode if meta.phase == "decode" else self.prefill

    @classmethod
    def supports(cls, kv_dtype: str, phase: str) -> bool:  # decided by the two parts (registry checks them)
        return True

    @classmethod
    def available(cls) -> tuple[bool, str]:
        return True, ""

    def plan(self, meta: AttentionMetadata, cache) -> None:
        self._pick(meta).plan(meta, cache)

    def forward(self, q, k, v, layer: AttentionLayer, cache, meta: AttentionMetadata):
        return self._pick(meta).forward(q, k, v, layer, cache, meta)

    def forward_mla(self, q_nope, q_pe, c_kv, k_pe, layer, cache, meta: AttentionMetadata):
        return self._pick(meta).forward_mla(q_nope, q_pe, c_kv, k_pe, layer, cache, meta)

    def __getattr__(self, item):  # graph hooks etc. are asked of the decode backend
        if item in ("prefill", "decode", "label"):
            raise AttributeError(item)
        return getattr(self.decode, item)
