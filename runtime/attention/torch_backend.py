"""The reference attention backend: plain torch, CPU or GPU, every KV format, both phases.

Per step (``plan``) it builds a padded ``[B, max_seq_len]`` slot table; per layer it applies RoPE,
appends the new K/V through ``PagedKVCache.write`` (the format's torch quantizer), gathers and
dequantizes each sequence's K/V, and runs masked softmax attention in float32 (GQA by head grouping,
sliding window, sinks).  In prefill the new tokens' own K/V enter in compute precision; in decode
everything is read back from the pages (see ``base.py``).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kvbench.runtime.attention.base import (
    AttentionLayer,
    AttentionMetadata,
    BackendOptions,
    apply_rope,
)
from kvbench.runtime.kv_cache import PagedKVCache

__all__ = ["TorchBackend", "quantize_query_fp8"]

_E4M3_MAX = 448.0


def quantize_query_fp8(q: torch.Tensor, q_scale: float) -> torch.Tensor:
    """Round q through float8_e4m3fn with a dequant multiplier ``q_scale`` (returns q's dtype)."""
    y = (q.float() / q_scale).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
    return (y.float() * q_scale).to(q.dtype)


class TorchBackend:
    name: ClassVar[str] = "torch"
    # capturable (no host syncs in decode), but a graph fixes the key length at max_model_len, which makes
    # this gather-everything reference far slower than eager: decode it eagerly
    graph_safe: ClassVar[bool] = False

    def __init__(self, opts: BackendOptions):
        self.opts = opts

    @classmethod
    def supports(cls, kv_dtype: str, phase: str) -> bool:
        return kv_dtype in ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "nvfp4") and phase in ("prefill", "decode")

    @classmethod
    def supports_mla(cls, kv_dtype: str, phase: str) -> bool:
        return cls.supports(kv_dtype, phase)

    @classmethod
    def available(cls) -> tuple[bool, str]:
        return True, ""

    def forward_mla(self, q_nope, q_pe, c_kv, k_pe, layer, cache, meta) -> torch.Tensor:
        """MLA layer (``mla_base.py``): latent append + expanded reference attention."""
        from kvbench.runtime.attention.mla_torch import torch_forward_mla

        return torch_forward_mla(self, q_nope, q_pe, c_kv, k_pe, layer, cache, meta)

    # ------------------------------------------------------------------------------------ plan
    def plan(self, meta: AttentionMetadata, cache: PagedKVCache) -> None:
        dev = meta.positions.device
        ps = meta.page_size
        B = meta.num_seqs
        seq_lens = meta.seq_lens.to(dev, torch.int64)
        cu = meta.cu_seqlens_q.to(dev, torch.int64)
        q_lens = cu[1:] - cu[:-1]
        max_s = max(int(meta.max_seqlen_k), 1)
        max_q = max(int(meta.max_seqlen_q), 1)
        pos = torch.arange(max_s, device=dev)
        table = meta.page_table.to(dev, torch.int64)
        pages = table[:, (pos // ps).clamp(max=table.shape[1] - 1)]
        slots = pages * ps + pos % ps
        kvalid = pos[None, :] < seq_lens[:, None]
        slots = torch.where(kvalid, slots, torch.full_like(slots, cache.scratch_page * ps))
        qi = torch.arange(max_q, device=dev)
        qvalid = qi[None, :] < q_lens[:, None]
        prefix = seq_lens - q_lens
        qpos = prefix[:, None] + qi[None, :]
        rows = (cu[:-1, None] + qi[None, :]).clamp(max=max(int(meta.num_tokens) - 1, 0))
        causal = pos[None, None, :] <= qpos[:, :, None]  # [B, Q, S]
        base_mask = causal & kvalid[:, None, :] & qvalid[:, :, None]
        meta.extra["torch"] = dict(
            slots=slots, qvalid=qvalid,
            valid_idx=torch.nonzero(qvalid, as_tuple=True) if meta.phase == "prefill" else None, qpos=qpos, rows=rows, prefix=prefix, base_mask=base_mask, B=B
        )

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
        st = meta.extra.get("torch")
        if st is None:
            self.plan(meta, cache)
            st = meta.extra["torch"]
        T = q.shape[0]
        H, Hk, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
        G = H // Hk
        qr = apply_rope(q, meta.positions, meta.rope)
        kr = apply_rope(k, meta.positions, meta.rope)
        cache.write(layer.layer_idx, meta.slot_mapping, kr, v)
        if self.opts.quantize_query:
            qr = quantize_query_fp8(qr, layer.q_scale)

        slots, rows, qvalid = st["slots"], st["rows"], st["qvalid"]
        B, S = slots.shape
        Q = rows.shape[1]
        kk, vv = cache.read_slots(layer.layer_idx, slots.reshape(-1), torch.float32)
        kk, vv = kk.view(B, S, Hk, D), vv.view(B, S, Hk, D)
        if meta.phase == "prefill":
            # new tokens' own K/V in compute precision, not round-tripped through the cache format
            bi, qi = st["valid_idx"]
            kpos = st["qpos"][bi, qi]
            kk = kk.clone()
            vv = vv.clone()
            kk[bi, kpos] = kr.float()[rows[bi, qi]]
            vv[bi, kpos] = v.float()[rows[bi, qi]]

        qq = qr.float()[rows].view(B, Q, Hk, G, D).permute(0, 2, 3, 1, 4)  # [B, Hk, G, Q, D]
        kt = kk.permute(0, 2, 3, 1)  # [B, Hk, D, S]
        scores = torch.matmul(qq, kt.unsqueeze(2)) * layer.softmax_scale  # [B, Hk, G, Q, S]
        mask = st["base_mask"]
        if layer.sliding_window is not None:
            kpos = torch.arange(S, device=mask.device)
            mask = mask & (kpos[None, None, :] > st["qpos"][:, :, None] - int(layer.sliding_window))
        scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
        if layer.sinks is not None:
            sink = layer.sinks.float().view(1, Hk, G, 1, 1).expand(B, Hk, G, Q, 1)
            logits = torch.cat((scores, sink), dim=-1)
            probs = torch.softmax(logits, dim=-1)[..., :-1]
        else:
            # rows with nothing visible (padding) would be all -inf -> NaN; give them a zero row
            safe = torch.where(mask.any(-1)[:, None, None, :, None], scores, torch.zeros_like(scores))
            probs = torch.softmax(safe, dim=-1)
        out = torch.matmul(probs, vv.permute(0, 2, 1, 3).unsqueeze(2))  # [B, Hk, G, Q, D]
        out = out.permute(0, 3, 1, 2, 4).reshape(B, Q, H * D)
        if meta.phase == "decode":  # one row per sequence, in order (rows past B are padding)
            res = torch.zeros(T, H * D, dtype=torch.float32, device=q.device)
            res[:B] = out[:, 0]
            return res.to(q.dtype)
        bi, qi = st["valid_idx"]
        res = torch.zeros(T, H * D, dtype=torch.float32, device=q.device)
        res[rows[bi, qi]] = out[bi, qi]
        return res.to(q.dtype)
