"""Hybrid backend: one backend for prefill steps, another for decode steps (``--prefill-backend`` /
``--decode-backend``).  Both write the same cache layout, so a sequence prefilled by one is decoded by
the other.

A mixed step (``meta.decode_rows``, ``mixed.mixed_parts``) of an attention (not MLA) model is cut in two: the
decode backend plans and runs the decode rows as a decode step, the prefill backend the other rows as a
prefill step (each appends its own rows' K/V before it reads, and the two parts are different sequences), and
the outputs are joined.  MLA layers (``forward_mla``) keep running a mixed step whole on the prefill backend,
whose decode rows are flagged round-trip (decode semantics in one extend)."""

from __future__ import annotations

from typing import ClassVar

from kvbench.runtime.attention.base import AttentionBackend, AttentionLayer, AttentionMetadata
from kvbench.runtime.attention.mixed import mixed_parts

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
        parts = mixed_parts(meta)
        if parts is not None:  # each part planned by the backend that runs it (an MLA step uses the whole plan)
            self.decode.plan(parts.decode, cache)
            self.prefill.plan(parts.prefill, cache)

    def forward(self, q, k, v, layer: AttentionLayer, cache, meta: AttentionMetadata):
        parts = mixed_parts(meta)
        if parts is None:
            return self._pick(meta).forward(q, k, v, layer, cache, meta)
        import torch

        n = parts.rows
        dec = self.decode.forward(q[:n], k[:n], v[:n], layer, cache, parts.decode)
        pre = self.prefill.forward(q[n:], k[n:], v[n:], layer, cache, parts.prefill)
        return torch.cat((dec, pre.to(dec.dtype)))

    def forward_mla(self, q_nope, q_pe, c_kv, k_pe, layer, cache, meta: AttentionMetadata):
        return self._pick(meta).forward_mla(q_nope, q_pe, c_kv, k_pe, layer, cache, meta)

    def __getattr__(self, item):  # graph hooks etc. are asked of the decode backend
        if item in ("prefill", "decode", "label"):
            raise AttributeError(item)
        return getattr(self.decode, item)
