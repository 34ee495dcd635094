"""The reference attention backend: plain torch, CPU or GPU, every KV format, both phases.

Per step (``plan``) it records each sequence's rows, prefix and whether its K/V all come from the pages
(decode, round-trip sequences) or its new tokens enter in compute precision (prefill); per layer it applies
RoPE, appends the new K/V through ``PagedKVCache.write`` (the format's torch quantizer), reads and
dequantizes, in one gather for the whole step, only the cached positions some query can see (a sliding
window skips the rest), and then attends **one sequence at a time in query chunks** with
``torch.nn.functional.scaled_dot_product_attention`` in float32 (GQA through ``enable_gqa``, an explicit
causal / sliding-window mask per chunk, keys sliced to the chunk's causal reach).  Nothing is padded to
the batch's longest sequence and no score tensor larger than one chunk's ``[H, C, S]`` exists, so an 8k
prefill on the CPU needs megabytes, not gigabytes, of attention workspace.

Sinks (one extra logit per query head in the softmax denominator only) ride in one extra head dimension:
q gets ``sink[h] / scale`` there, an appended all-zero key gets 1 there and a zero value, so that key's
logit is exactly ``sink[h]`` and it contributes nothing to the output.

Semantics are those of ``base.py``: in prefill the new tokens' own K/V enter in compute precision; in
decode, and for round-trip sequences, everything is read back from the pages.

Its decode path is the same per-sequence loop with every sequence reading from the pages (``TorchPlan.from_cache``).
A mixed step (``meta.decode_rows``) appends every row first and runs its decode rows through that decode path
(``make_plan`` marks them from the pages whether or not they are flagged round-trip) and its other rows through
the prefill path, each sequence on its own, into one output: the split of ``mixed.mixed_parts`` without building
the parts.
"""

from __future__ import annotations

from typing import ClassVar, Optional

import torch

from kvbench.core import is_supported
from kvbench.runtime.attention.base import (
    AttentionLayer,
    AttentionMetadata,
    BackendOptions,
    apply_rope,
    layer_pages,
    layer_rope,
)
from kvbench.runtime.kv_cache import PagedKVCache

from kvbench.runtime.attention.torch_ops import (
    SCORE_TILE_BYTES,
    TorchPlan,
    attend_chunked,
    make_plan,
    quantize_query_fp8,
    quantize_step_query,
    seq_kv,
)

# the helpers stay importable from here (the flashinfer backend, the diagnostics probe and tests use them)
__all__ = ["TorchBackend", "TorchPlan", "quantize_query_fp8", "quantize_step_query", "attend_chunked", "SCORE_TILE_BYTES"]


class TorchBackend:
    name: ClassVar[str] = "torch"
    # decode loops over sequences on the host: eager only
    graph_safe: ClassVar[bool] = False

    def __init__(self, opts: BackendOptions):
        self.opts = opts
        chunk = (opts.extra or {}).get("torch_query_chunk")
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"torch_query_chunk must be a positive integer, got {chunk!r}")
        self.query_chunk: Optional[int] = chunk

    @classmethod
    def supports(cls, kv_dtype: str, phase: str) -> bool:  # the backend table (core/backends.py): every format
        return is_supported(cls.name, kv_dtype, phase)

    @classmethod
    def supports_mla(cls, kv_dtype: str, phase: str) -> bool:
        return is_supported(cls.name, kv_dtype, phase, mla=True)

    @classmethod
    def available(cls) -> tuple[bool, str]:
        return True, ""

    def forward_mla(self, q_nope, q_pe, c_kv, k_pe, layer, cache, meta) -> torch.Tensor:
        """MLA layer (``mla_base.py``): latent append + expanded reference attention."""
        from kvbench.runtime.attention.mla_torch import torch_forward_mla

        return torch_forward_mla(self, q_nope, q_pe, c_kv, k_pe, layer, cache, meta)

    # ------------------------------------------------------------------------------------ plan
    def plan(self, meta: AttentionMetadata, cache: PagedKVCache) -> None:
        meta.extra["torch"] = make_plan(meta)

    def step_plan(self, meta: AttentionMetadata, cache: PagedKVCache) -> TorchPlan:
        st = meta.extra.get("torch")
        if not isinstance(st, TorchPlan):
            self.plan(meta, cache)
            st = meta.extra["torch"]
        return st

    # --------------------------------------------------------------------------------- forward
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        cache: PagedKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        st = self.step_plan(meta, cache)
        T = q.shape[0]
        H, D = layer.num_heads, layer.head_dim
        rope = layer_rope(meta, layer)
        qr = apply_rope(q, meta.positions, rope)
        kr = apply_rope(k, meta.positions, rope)
        group = cache.spec.group_of(layer.layer_idx) if meta.group_page_tables else 0
        cache.write(layer.layer_idx, layer_pages(meta, cache, layer.layer_idx)[1], kr, v)
        qr = quantize_step_query(qr, layer.q_scale, self.opts, meta)

        slots, offs, los, ns = st.reads(layer.sliding_window, group)
        kc, vc = cache.read_slots(layer.layer_idx, slots, torch.float32)
        res = torch.zeros(T, H * D, dtype=torch.float32, device=q.device)  # padding rows stay zero
        for b in range(st.B):
            r0, r1 = st.cu[b], st.cu[b + 1]
            if r1 == r0:
                continue
            kb = seq_kv(st, b, kc, offs, ns, kr)
            vb = seq_kv(st, b, vc, offs, ns, v)
            o = attend_chunked(
                qr[r0:r1].float(), kb, vb, st.seq_lens[b] - st.q_lens[b], los[b], layer.softmax_scale,
                layer.sliding_window, layer.sinks, self.query_chunk,
            )
            res[r0:r1] = o.reshape(r1 - r0, H * D)
        return res.to(q.dtype)
