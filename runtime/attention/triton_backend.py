"""The Triton attention backend: fused (or unfused) RoPE + quantize + append, then paged prefill or
decode attention, all from ``kvbench.kernels`` (every KV format, both phases).

Runs on a CUDA device, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``; slow, for
tests).  Numbers agree with the torch backend up to the compute dtype's rounding: same RoPE (float32,
same operation order), same quantizer (``kernels/formats.py``, bit for bit on the GPU), same attention
semantics (``base.py``).  Round-trip sequences (scoring with decode semantics): after the append, their new
rows' K/V are read back from the pages (``stored_new_kv``) and passed to the prefill kernel as the new
tokens' K/V, so they see exactly the bytes decode would read.

Mixed steps (``meta.decode_rows``, ``mixed.mixed_parts``): one RoPE + quantize + append over every row of the
step (so each decode row's new K/V is in its pages before anything reads them), then the decode rows (the
first ``decode_rows`` rows) go through ``paged_decode`` exactly as a decode step's rows would, and the other
rows through ``paged_prefill`` over the prefill part's page-table rows, lengths and rebased ``cu_seqlens_q``
(its round-trip rows, e.g. a scored continuation chunk, read back as above), both writing into one output.

fp8 queries (``quantize_query``, per phase: ``base.query_fp8``): when every row of a step is quantized the
append kernel emits the e4m3 query and the attention kernel gets ``q_scale``; a phase that is not quantized
passes ``q_scale=None``.  A prefill step that mixes the two (round-trip rows under the decode setting next
to plain rows under the prefill one) rounds the quantized rows through e4m3 in torch and hands the kernel a
compute-dtype query with ``q_scale=None`` (the same values up to the compute dtype's rounding of
``e4m3 * q_scale``).
"""

from __future__ import annotations

import os
from typing import ClassVar

import torch

from kvbench.core import is_supported
from kvbench.runtime.attention.base import (AttentionLayer, AttentionMetadata, BackendOptions, RopeCache, layer_pages,
                                            layer_rope, query_fp8, query_fp8_rows, stored_new_kv)
from kvbench.runtime.attention.mixed import mixed_parts

__all__ = ["TritonBackend", "stored_new_kv"]



class TritonBackend:
    name: ClassVar[str] = "triton"
    graph_safe: ClassVar[bool] = True  # no host syncs, split bounds computed on the device

    def __init__(self, opts: BackendOptions):
        self.opts = opts
        self._cos_sin: dict[int, tuple[RopeCache, torch.Tensor]] = {}
        self._q_scales: dict[tuple[float, str], torch.Tensor] = {}

    @classmethod
    def supports(cls, kv_dtype: str, phase: str) -> bool:  # the backend table (core/backends.py)
        return is_supported(cls.name, kv_dtype, phase)

    @classmethod
    def supports_mla(cls, kv_dtype: str, phase: str) -> bool:
        return is_supported(cls.name, kv_dtype, phase, mla=True)

    def forward_mla(self, q_nope, q_pe, c_kv, k_pe, layer, cache, meta) -> torch.Tensor:
        """MLA layer (``mla_base.py``): fused latent append + absorbed decode/prefill kernels."""
        from kvbench.runtime.attention.mla_triton import triton_forward_mla

        return triton_forward_mla(self, q_nope, q_pe, c_kv, k_pe, layer, cache, meta)

    @classmethod
    def available(cls) -> tuple[bool, str]:
        try:
            import triton  # noqa: F401
        except ImportError as e:  # pragma: no cover - triton is a dependency on Linux
            return False, f"triton is not importable ({e})"
        if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            return True, ""
        return False, "needs a CUDA device (or TRITON_INTERPRET=1 to run the kernels on the CPU, slowly)"

    def plan(self, meta: AttentionMetadata, cache) -> None:
        """Nothing to plan: the kernels read the page table and lengths on the device."""

    # ------------------------------------------------------------------------------ helpers
    def _cos_sin_cache(self, rope: RopeCache) -> torch.Tensor:
        hit = self._cos_sin.get(id(rope))
        if hit is None or hit[0] is not rope:
            table = torch.cat((rope.cos, rope.sin), dim=-1).float().contiguous()
            hit = (rope, table)
            self._cos_sin[id(rope)] = hit
        return hit[1]

    def _q_scale(self, value: float, device: torch.device) -> torch.Tensor:
        key = (float(value), str(device))
        t = self._q_scales.get(key)
        if t is None:
            t = torch.tensor([float(value)], dtype=torch.float32, device=device)
            self._q_scales[key] = t
        return t

    @staticmethod
    def _max_prefix(meta: AttentionMetadata):
        """The step's longest cached prefix (host lists; None when the caller gave none), computed once per
        step rather than once per layer."""
        if "triton_max_prefix" not in meta.extra:
            pre = meta.prefix_lens_cpu if meta.seq_lens_cpu and meta.q_lens_cpu else None
            meta.extra["triton_max_prefix"] = max(pre) if pre else None
        return meta.extra["triton_max_prefix"]

    # ------------------------------------------------------------------------------ forward
    def forward(self, q, k, v, layer: AttentionLayer, cache, meta: AttentionMetadata) -> torch.Tensor:
        from kvbench.kernels import fused_rope_quant_append, unfused_rope_quant_append
        from kvbench.kernels import AttentionParams, PagedKV, PrefillOptions
        from kvbench.kernels import paged_decode
        from kvbench.kernels import paged_prefill

        li = layer.layer_idx
        fmt = cache.fmt_of(li).name
        T, H, D = q.shape
        kv = PagedKV(fmt, cache.k_data[li], cache.v_data[li], cache.k_scale[li], cache.v_scale[li],
                     cache.k_block_scale[li], cache.v_block_scale[li])
        which = query_fp8(self.opts, meta)
        q_scale = self._q_scale(layer.q_scale, q.device) if which is True else None
        append = fused_rope_quant_append if self.opts.fused_append else unfused_rope_quant_append
        rope = layer_rope(meta, layer)
        page_table, slot_mapping = layer_pages(meta, cache, li)
        app = append(
            q, k, v, meta.positions, slot_mapping, self._cos_sin_cache(rope), kv,
            rotary_dim=rope.rotary_dim, rope_style=rope.style, q_scale=q_scale,
        )
        qq = app.q_fp8 if q_scale is not None else app.q
        if which is not True and which is not False:  # mixed step: the quantized rows rounded in torch
            from kvbench.runtime.attention.torch_backend import quantize_query_fp8

            rows = query_fp8_rows(which, meta, T)[:, None, None]
            qq = torch.where(rows, quantize_query_fp8(app.q, layer.q_scale), app.q)
        attn = AttentionParams(sm_scale=layer.softmax_scale, sliding_window=layer.sliding_window, sinks=layer.sinks,
                               q_scale=q_scale)
        parts = mixed_parts(meta)
        if meta.phase == "decode":
            B = meta.num_seqs
            out = torch.zeros(T, H, D, dtype=q.dtype, device=q.device) if T != B else None
            res = paged_decode(qq[:B], kv, page_table, meta.seq_lens, attn=attn, out_dtype=q.dtype)
            if out is None:
                out = res
            else:
                out[:B] = res
        elif parts is not None:  # mixed step: every row appended above; decode rows, then the prefill rows
            n, dec, pre = parts.rows, parts.decode, parts.prefill
            out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
            paged_decode(qq[:n], kv, layer_pages(dec, cache, li)[0], dec.seq_lens, attn=attn, out=out[:n],
                         out_dtype=q.dtype)  # (the dtype also picks the kernel's dot for an fp8 query)
            k_new, v_new = app.k[n:], v[n:]
            if pre.has_roundtrip:
                k_new, v_new = stored_new_kv(cache, li, pre, k_new, v_new)
            paged_prefill(
                qq[n:], k_new, v_new, pre.cu_seqlens_q, int(pre.max_seqlen_q), kv, layer_pages(pre, cache, li)[0],
                pre.seq_lens, attn=attn, out=out[n:], out_dtype=q.dtype,
                opts=PrefillOptions(max_prefix_len=self._max_prefix(pre)),
            )
        else:
            k_new, v_new = stored_new_kv(cache, li, meta, app.k, v) if meta.has_roundtrip else (app.k, v)
            out = paged_prefill(
                qq, k_new, v_new, meta.cu_seqlens_q, int(meta.max_seqlen_q), kv, page_table, meta.seq_lens,
                attn=attn, out_dtype=q.dtype, opts=PrefillOptions(max_prefix_len=self._max_prefix(meta)),
            )
        return out.reshape(T, H * D)
