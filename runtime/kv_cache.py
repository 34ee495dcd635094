"""Paged KV cache: page pool per layer in any KV format, page allocator, slot mapping, capacity.

Invariants (every backend and kernel relies on them):
- Per layer and plane (K, V; MLA has only the latent plane K): ``data[num_pages + 1, page_size, H_kv, Dp]``
  in the format's storage dtype (uint8 with Dp = D/2 for nvfp4); for block-scaled formats (nvfp4)
  ``block_scale`` of shape ``[num_pages + 1, page_size, H_kv, D/block]`` in the block scale's dtype
  (float8_e4m3fn); for formats with a per-token scale ``token_scale`` of shape ``[num_pages + 1, page_size,
  H_kv]`` beside the pages.  The layout comes from the format table (``kvbench.core.formats``).  Page
  ``num_pages`` is the scratch page: it is never handed out, so padded work may point at it.
- Per-tensor scales: fp32 ``k_scale[layer]``, ``v_scale[layer]`` of shape ``[H_kv]`` on the cache device
  (a per-layer scale is repeated over heads), updated in place so pointers stay valid.
- ``slot = page_table[pos // page_size] * page_size + pos % page_size``; slot −1 writes nothing.
- A page is either free (in the allocator's free list) or owned by exactly one sequence.
- Mixed per-layer formats (``KVCacheSpec.layer_dtypes``): each layer's planes are laid out in that layer's
  format (``fmt_of(layer)``); pages, page ids and slots are shared by every layer, so one page holds a
  token range in every layer whatever its format.
- Layer groups (``KVCacheSpec.groups``, ``runtime/layer_groups.py``): layer ``j`` of every group stores into
  plane slot ``j`` (``k_data[layer]`` is its slot's tensor), each group has its own page list per sequence and
  slot mapping per step (``AttentionMetadata.group_page_tables`` / ``group_slot_mappings``), and a page id
  holds one group's layers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import torch

from kvbench.core import get_spec
from kvbench.kernels import KVFormat, QuantizedKV, get_format
from kvbench.runtime.config import KVCacheSpec

__all__ = [
    "OutOfPages",
    "PageAllocator",
    "PagedKVCache",
    "CapacityPlan",
    "bytes_per_token",
    "plan_capacity",
    "slots_for_positions",
    "windowed_capacity",
]


class OutOfPages(RuntimeError):
    """The allocator cannot satisfy a request (the scheduler preempts or waits)."""


# ------------------------------------------------------------------------------------ allocator
class PageAllocator:
    """Free-list page allocator.  LIFO reuse keeps recently freed (cache-warm) pages hot."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"need at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._owned = bytearray(num_pages)  # 1 = allocated

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(f"requested {n} pages, {len(self._free)} free of {self.num_pages}")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._owned[p] = 1
        return pages

    def free(self, pages: Sequence[int]) -> None:
        for p in pages:
            if not 0 <= p < self.num_pages or not self._owned[p]:
                raise ValueError(f"double free or foreign page {p}")
            self._owned[p] = 0
            self._free.append(p)


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def slots_for_positions(page_table: Sequence[int], positions: Sequence[int] | torch.Tensor, page_size: int) -> torch.Tensor:
    """Slot index of each position of one sequence (int64 tensor)."""
    pos = torch.as_tensor(positions, dtype=torch.int64)
    table = torch.as_tensor(list(page_table), dtype=torch.int64)
    if pos.numel() and int(pos.max()) >= len(table) * page_size:
        raise IndexError(f"position {int(pos.max())} beyond the {len(table)} pages of this sequence")
    return table[pos // page_size] * page_size + pos % page_size


# ------------------------------------------------------------------------------------- capacity
def bytes_per_token(spec: KVCacheSpec) -> float:
    """KV bytes one token occupies across all layers, scales included (block and per-token scales).  With layer
    groups: one token of one page id, which spans one group's layers (``runtime/layer_groups.py``)."""
    if spec.groups is not None:
        first = {}
        for i, s in enumerate(spec.groups.slot_of):
            first.setdefault(s, spec.formats[i])
        return float(sum(spec.planes * spec.num_kv_heads * get_spec(f).bytes_per_token(spec.head_dim) for f in first.values()))
    if spec.mixed:  # each layer in its own format
        return float(sum(spec.planes * spec.num_kv_heads * get_spec(f).bytes_per_token(spec.head_dim) for f in spec.formats))
    return spec.planes * spec.num_layers * spec.num_kv_heads * get_spec(spec.kv_dtype).bytes_per_token(spec.head_dim)


@dataclass
class CapacityPlan:
    kv_dtype: str
    page_size: int
    bytes_per_token: float
    num_pages: int
    tokens: int
    kv_bytes: int
    context_len: int
    max_concurrency: int

    def to_dict(self) -> dict:
        return asdict(self)


def plan_capacity(spec: KVCacheSpec, budget_bytes: float, context_len: int) -> CapacityPlan:
    """Pages, tokens and max concurrent sequences of ``context_len`` tokens that fit ``budget_bytes``."""
    if context_len <= 0:
        raise ValueError(f"context_len must be positive, got {context_len}")
    if not (math.isfinite(budget_bytes) and budget_bytes > 0):
        raise ValueError(f"budget_bytes must be positive and finite, got {budget_bytes}")
    if spec.page_size <= 0 or spec.page_size & (spec.page_size - 1):
        raise ValueError(f"page_size must be a positive power of two, got {spec.page_size}")
    bpt = bytes_per_token(spec)
    page_bytes = bpt * spec.page_size
    num_pages = int(budget_bytes // page_bytes)
    per_seq = pages_needed(context_len, spec.page_size)
    tokens = num_pages * spec.page_size
    if spec.groups is not None:  # page ids of every group; tokens: the longest context one sequence can hold
        per_seq = spec.groups.pages_per_seq(context_len, spec.page_size)
        tokens = spec.groups.longest_context(num_pages, spec.page_size)
    return CapacityPlan(
        kv_dtype=spec.kv_dtype,
        page_size=spec.page_size,
        bytes_per_token=bpt,
        num_pages=num_pages,
        tokens=tokens,
        kv_bytes=int(math.ceil(num_pages * page_bytes)),
        context_len=context_len,
        max_concurrency=num_pages // per_seq,
    )


def windowed_capacity(spec: KVCacheSpec, windows: Sequence, budget_bytes: float, context_len: int) -> dict:
    """Capacity when each sliding-window layer keeps only the pages its window can still reach (``ceil(W /
    page) + 1`` per sequence, what an allocator with a page table per layer group holds; this cache keeps
    every layer's pages for the whole context): ``sliding_layers``, ``windowed_bytes_per_seq`` and
    ``max_concurrency_windowed`` of sequences of ``context_len`` tokens in ``budget_bytes``.  Bytes of a
    layer's page count its own format (a mixed map included)."""
    if len(windows) != spec.num_layers:
        raise ValueError(f"{len(windows)} windows for {spec.num_layers} layers")
    ps = spec.page_size
    full_pages = pages_needed(context_len, ps)
    per_seq = 0.0
    for fmt, w in zip(spec.formats, windows):
        pages = full_pages if w is None else min(full_pages, -(-int(w) // ps) + 1)
        per_seq += pages * ps * spec.planes * spec.num_kv_heads * get_spec(fmt).bytes_per_token(spec.head_dim)
    return {"num_layers": spec.num_layers, "sliding_layers": sum(w is not None for w in windows), "windowed_bytes_per_seq": per_seq,
            "max_concurrency_windowed": int(budget_bytes // per_seq) if per_seq else 0}


# ------------------------------------------------------------------------------------ the pool
class PagedKVCache:
    """The page pool of one model.  Owns tensors and the allocator; sequences own page-id lists."""

    def __init__(
        self,
        spec: KVCacheSpec,
        num_pages: int,
        device: str | torch.device = "cpu",
        k_scale: Optional[torch.Tensor] = None,
        v_scale: Optional[torch.Tensor] = None,
    ):
        self.spec = spec
        self.fmt: KVFormat = get_format(spec.kv_dtype)  # the main format (every layer's unless spec.mixed)
        self.formats: list[KVFormat] = [get_format(f) for f in spec.formats]
        self.num_pages = num_pages
        self.page_size = spec.page_size
        self.device = torch.device(device)
        self.scratch_page = num_pages
        self.allocator = PageAllocator(num_pages)
        L, H, D = spec.num_layers, spec.num_kv_heads, spec.head_dim
        hnd = spec.layout == "HND"

        def alloc(shp, make) -> torch.Tensor:
            # HND: the memory is [P+1, H, page, X]; the plane is its [P+1, page, H, X] view
            if not hnd:
                return make(shp)
            return make((shp[0], shp[2], shp[1], shp[3])).permute(0, 2, 1, 3)

        def scale_plane(on: bool, shp, dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
            if not on:
                return None
            # the smallest normal of the scale's dtype (2^-6 for e4m3) keeps never-written entries finite
            # and non-zero
            fill = torch.finfo(dtype).smallest_normal
            return alloc(shp, lambda s: torch.full(s, fill, device=self.device).to(dtype))

        def layer_planes(fmt: KVFormat) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
            fs = get_spec(fmt.name)
            data = alloc((num_pages + 1, spec.page_size, H, fmt.packed_dim(D)),
                         lambda s: torch.zeros(s, dtype=fmt.storage_dtype, device=self.device))
            bs = scale_plane(fs.has_block_scales, (num_pages + 1, spec.page_size, H, fs.blocks(D)), fmt.block_scale_dtype)
            # per-token scales: a [P+1, page, H] view of a trailing unit dim (same page layout as the data)
            ts = scale_plane(fs.token_scale, (num_pages + 1, spec.page_size, H, 1), getattr(torch, fs.token_scale_storage))
            return data, bs, None if ts is None else ts[..., 0]

        def plane() -> tuple[list[torch.Tensor], list[Optional[torch.Tensor]], list[Optional[torch.Tensor]]]:
            if spec.groups is None:
                per_layer = [layer_planes(f) for f in self.formats]
            else:  # layer j of every group stores into plane slot j (one tensor per slot)
                slots: dict = {}
                per_layer = []
                for s, f in zip(spec.groups.slot_of, self.formats):
                    if s not in slots:
                        slots[s] = layer_planes(f)
                    per_layer.append(slots[s])
            return [p[0] for p in per_layer], [p[1] for p in per_layer], [p[2] for p in per_layer]

        self.k_data, self.k_block_scale, self.k_token_scale = plane()
        if spec.mla:
            self.v_data, self.v_block_scale, self.v_token_scale = self.k_data, self.k_block_scale, self.k_token_scale
        else:
            self.v_data, self.v_block_scale, self.v_token_scale = plane()
        self.k_scale = torch.ones(L, H, dtype=torch.float32, device=self.device)
        self.v_scale = self.k_scale if spec.mla else torch.ones_like(self.k_scale)
        if k_scale is not None or v_scale is not None:
            self.set_scales(k_scale, v_scale)

    def fmt_of(self, layer: int) -> KVFormat:
        """The format of ``layer``'s planes (``fmt`` unless the cache mixes formats per layer)."""
        return self.formats[layer]

    def set_scales(self, k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor] = None) -> None:
        """Update scales in place (``[L]`` per layer or ``[L, H_kv]`` per head)."""
        for dst, src in ((self.k_scale, k_scale), (self.v_scale, v_scale)):
            if src is None:
                continue
            src = torch.as_tensor(src, dtype=torch.float32, device=self.device)
            if src.dim() == 1:
                src = src[:, None].expand_as(dst)
            if not torch.isfinite(src).all() or (src <= 0).any():
                raise ValueError("KV scales must be finite and positive")
            dst.copy_(src)

    # -- sizes
    @property
    def bytes_per_token(self) -> float:
        return bytes_per_token(self.spec)

    @property
    def total_bytes(self) -> int:
        planes = [self.k_data, self.k_block_scale, self.k_token_scale]
        if not self.spec.mla:
            planes += [self.v_data, self.v_block_scale, self.v_token_scale]
        unique = {id(t): t for ts in planes for t in ts if t is not None}  # layer groups share plane slots
        return sum(t.numel() * t.element_size() for t in unique.values())

    # -- write / read (torch reference path; Triton kernels write the same bytes)
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: Optional[torch.Tensor] = None) -> None:
        """Quantize ``k``/``v`` ``[T, H_kv, D]`` with the layer's scales and store them at ``slots``.

        Slot −1 writes nothing outside the scratch page (whose contents are never read)."""
        slots = torch.as_tensor(slots, device=self.device, dtype=torch.int64)
        # padded tokens (slot −1) land in the scratch page: no host sync, so CUDA graphs can capture this
        slots = torch.where(slots >= 0, slots, torch.full_like(slots, self.scratch_page * self.page_size))
        fmt = self.formats[layer]
        self._store("k", layer, slots, fmt.quantize(k, self.k_scale[layer]))
        if v is not None and not self.spec.mla:
            self._store("v", layer, slots, fmt.quantize(v, self.v_scale[layer]))

    def planes_of(self, which: str, layer: int) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(data, block_scale, token_scale)`` of plane ``which`` ("k" or "v") of ``layer`` (None where the
        format has no such scale)."""
        if which == "k":
            return self.k_data[layer], self.k_block_scale[layer], self.k_token_scale[layer]
        return self.v_data[layer], self.v_block_scale[layer], self.v_token_scale[layer]

    def _store(self, which: str, layer: int, slots: torch.Tensor, q: QuantizedKV) -> None:
        data, bs, ts = self.planes_of(which, layer)
        page, off = slots // self.page_size, slots % self.page_size  # (page, offset): any page layout
        data[page, off] = q.data
        if bs is not None:
            bs[page, off] = q.block_scale
        if ts is not None:
            ts[page, off] = q.token_scale.to(ts.dtype)

    def read_slots(self, layer: int, slots: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K and V ``[n, H_kv, D]`` at the given slots."""
        slots = torch.as_tensor(slots, device=self.device, dtype=torch.int64)
        return self._load(layer, "k", slots, dtype), self._load(layer, "v", slots, dtype)

    def _load(self, layer: int, which: str, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        data, bs, ts = self.planes_of(which, layer)
        scale = (self.k_scale if which == "k" else self.v_scale)[layer]
        page, off = slots // self.page_size, slots % self.page_size
        q = QuantizedKV(data[page, off], None if bs is None else bs[page, off], None if ts is None else ts[page, off])
        return self.formats[layer].dequantize(q, scale, dtype)

    def gather(self, layer: int, page_table: Sequence[int] | torch.Tensor, length: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K and V ``[length, H_kv, D]`` of one sequence's first ``length`` tokens."""
        table = torch.as_tensor(page_table, dtype=torch.int64, device=self.device).flatten()
        slots = slots_for_positions(table.cpu().tolist(), torch.arange(length), self.page_size).to(self.device)
        return self.read_slots(layer, slots, dtype)

    # -- capacity
    def capacity(self, context_len: int) -> CapacityPlan:
        return plan_capacity(self.spec, self.num_pages * self.page_size * self.bytes_per_token, context_len)
