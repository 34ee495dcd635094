"""FlashInfer backend (GPU, optional): FlashInfer's paged decode and prefill kernels over the cache
layout of ``runtime/kv_cache.py`` (HND or NHD pages, K and V planes separate).

Round-trip sequences (scoring with decode semantics, ``base.py``) need nothing extra: FlashInfer's prefill
reads the new tokens' K/V back from the pages, and it runs only when the cache keeps the compute dtype, so
what it reads is the stored value.

RoPE, quantization and append use the torch reference path (``PagedKVCache.write``); attention
runs in FlashInfer.  Per-tensor / per-head fp8 scales are folded exactly: ``k_scale`` into q (per kv
head) and ``v_scale`` into the output, so no scale is passed as a Python float.

Supported: decode in bf16, fp16, fp8_e4m3, fp8_e5m2; prefill in bf16, fp16 when the cache keeps the
compute dtype and head_dim is 64, 128 or 256 (FlashInfer reads the new tokens' K/V back from the pages, which equals the compute-precision
values only then; its Hopper prefill kernels also do not compile for bf16 q with an fp16 cache).  No nvfp4, no attention sinks.  Sliding windows map to ``window_left = W - 1``.
Install: ``pip install flashinfer-python`` (needs a CUDA device; kernels compile just in time).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kvbench.core import is_supported
from kvbench.runtime.attention.base import AttentionLayer, AttentionMetadata, BackendOptions, apply_rope, layer_rope
from kvbench.runtime.attention.torch_backend import quantize_step_query

__all__ = ["FlashInferBackend"]

_WORKSPACE = 256 * 2**20


class FlashInferBackend:
    name: ClassVar[str] = "flashinfer"
    graph_safe: ClassVar[bool] = False  # plans on the host every step

    def __init__(self, opts: BackendOptions):
        import flashinfer

        self.fi = flashinfer
        self.opts = opts
        self.workspace = torch.empty(_WORKSPACE, dtype=torch.uint8, device=opts.device)
        self._wrappers: dict = {}

    @classmethod
    def supports(cls, kv_dtype: str, phase: str) -> bool:  # the backend table (core/backends.py)
        return is_supported(cls.name, kv_dtype, phase)

    @classmethod
    def supports_mla(cls, kv_dtype: str, phase: str) -> bool:
        """FlashInfer's MLA kernels expect another latent layout; MLA models run on torch or triton (the
        table says ``mla=False``)."""
        return is_supported(cls.name, kv_dtype, phase, mla=True)

    @classmethod
    def available(cls) -> tuple[bool, str]:
        try:
            import flashinfer  # noqa: F401
        except Exception as e:
            return False, f"flashinfer is not importable ({type(e).__name__}: {e}); install it with `pip install flashinfer-python` on a CUDA machine"
        if not torch.cuda.is_available():
            return False, "flashinfer needs a CUDA device"
        return True, ""

    # ---------------------------------------------------------------------------------- plan
    def plan(self, meta: AttentionMetadata, cache) -> None:
        ps = meta.page_size
        lens = meta.seq_lens.to(torch.int64)
        npages = (lens + ps - 1) // ps
        cols = torch.arange(meta.page_table.shape[1], device=lens.device)
        indices = meta.page_table[cols[None, :] < npages[:, None]].to(torch.int32)
        indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device=lens.device)
        indptr[1:] = torch.cumsum(npages, 0)
        last = (lens - (npages - 1) * ps).to(torch.int32)
        meta.extra["flashinfer"] = {"indptr": indptr, "indices": indices, "last": last, "planned": {}}

    def _wrapper(self, meta: AttentionMetadata, layer: AttentionLayer, cache, q_dtype):
        st = meta.extra.get("flashinfer") or (self.plan(meta, cache) or meta.extra["flashinfer"])
        window = -1 if layer.sliding_window is None else int(layer.sliding_window) - 1
        kv_dtype = cache.k_data[layer.layer_idx].dtype  # per layer: a mixed cache has layers of several formats
        key = (meta.phase, window, kv_dtype)
        w = st["planned"].get(key)
        if w is not None:
            return w
        layout = cache.spec.layout
        wk = (meta.phase, window, layout, kv_dtype)
        if meta.phase == "decode":
            w = self._wrappers.get(wk) or self.fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, layout)
            w.plan(st["indptr"], st["indices"], st["last"], layer.num_heads, layer.num_kv_heads, layer.head_dim,
                   meta.page_size, pos_encoding_mode="NONE", window_left=window, q_data_type=q_dtype,
                   kv_data_type=kv_dtype, sm_scale=layer.softmax_scale)
        else:
            w = self._wrappers.get(wk) or self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, layout)
            w.plan(meta.cu_seqlens_q, st["indptr"], st["indices"], st["last"], layer.num_heads, layer.num_kv_heads,
                   layer.head_dim, meta.page_size, causal=True, pos_encoding_mode="NONE", window_left=window,
                   q_data_type=q_dtype, kv_data_type=kv_dtype, sm_scale=layer.softmax_scale)
        self._wrappers[wk] = w
        st["planned"][key] = w
        return w

    # ------------------------------------------------------------------------------- forward
    def forward(self, q, k, v, layer: AttentionLayer, cache, meta: AttentionMetadata) -> torch.Tensor:
        if layer.sinks is not None:
            raise NotImplementedError("the flashinfer backend does not support attention sinks; use triton or torch")
        if meta.group_page_tables:  # the engine keeps one page list with flashinfer (engine_setup.window_pages)
            raise NotImplementedError("the flashinfer backend reads one page table, not one per layer group")
        li = layer.layer_idx
        T, H, D = q.shape
        if meta.phase == "prefill" and cache.k_data[li].dtype != q.dtype:
            raise NotImplementedError(
                f"flashinfer prefill needs the KV cache in the compute dtype ({q.dtype}), not {cache.k_data[li].dtype}; "
                "use --prefill-backend triton or torch (or --dtype to match)"
            )
        rope = layer_rope(meta, layer)
        qr = apply_rope(q, meta.positions, rope)
        kr = apply_rope(k, meta.positions, rope)
        cache.write(li, meta.slot_mapping, kr, v)
        qr = quantize_step_query(qr, layer.q_scale, self.opts, meta)
        G = H // layer.num_kv_heads
        ks, vs = cache.k_scale[li], cache.v_scale[li]
        quantized = cache.fmt_of(li).is_quantized
        if quantized:  # exact folding of the dequant multipliers
            qr = (qr.float() * ks.repeat_interleave(G)[None, :, None]).to(q.dtype)
        w = self._wrapper(meta, layer, cache, qr.dtype)
        kc, vc = cache.k_data[li], cache.v_data[li]
        if cache.spec.layout == "HND":  # flashinfer takes the HND memory as [P+1, H, page, D]
            kc, vc = kc.permute(0, 2, 1, 3), vc.permute(0, 2, 1, 3)
        out = w.run(qr.contiguous(), (kc, vc))
        if quantized:
            out = (out.float() * vs.repeat_interleave(G)[None, :, None]).to(q.dtype)
        return out.reshape(T, H * D)
