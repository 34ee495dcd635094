"""The torch reference backend's building blocks, shared with its MLA path (mla_torch.py): fp8 query rounding,
query chunking, chunked SDPA over one sequence (``attend_chunked``), the per-step plan (``TorchPlan``) and a
sequence's keys (``seq_kv``).  runtime/attention/torch_backend.py says what the backend does with them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from kvbench.runtime.attention.base import AttentionMetadata, BackendOptions, query_fp8, query_fp8_rows

__all__ = ["TorchPlan", "make_plan", "quantize_query_fp8", "quantize_step_query", "query_chunk", "attend_chunked",
           "seq_kv", "SCORE_TILE_BYTES"]

_E4M3_MAX = 448.0

# Query chunk size: the largest C whose float32 score tile [H, C, S] fits this many bytes (SDPA's fused CPU
# kernel never builds the tile; its math fallback, e.g. MLA's unequal head dims, builds one per chunk).
# ``BackendOptions.extra["torch_query_chunk"]`` fixes C instead (tests force small chunks with it).
SCORE_TILE_BYTES = 64 * 2**20


def quantize_query_fp8(q: torch.Tensor, q_scale: float) -> torch.Tensor:
    """Round q through float8_e4m3fn with a dequant multiplier ``q_scale`` (returns q's dtype)."""
    y = (q.float() / q_scale).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
    return (y.float() * q_scale).to(q.dtype)


def quantize_step_query(q: torch.Tensor, q_scale: float, opts: BackendOptions, meta: AttentionMetadata) -> torch.Tensor:
    """``q`` ``[T, H, D]`` (after RoPE) with the rows this step quantizes (``base.query_fp8``: the phase's
    setting; round-trip rows of a prefill step follow the decode setting) rounded through fp8."""
    which = query_fp8(opts, meta)
    if which is False:
        return q
    if which is True:
        return quantize_query_fp8(q, q_scale)
    rows = query_fp8_rows(which, meta, q.shape[0])[:, None, None]
    return torch.where(rows, quantize_query_fp8(q, q_scale), q)


def query_chunk(num_heads: int, num_keys: int, fixed: Optional[int] = None) -> int:
    """Queries per attention chunk: ``fixed`` when given, else what keeps ``[H, C, S]`` float32 within
    ``SCORE_TILE_BYTES`` (at least 1)."""
    if fixed is not None:
        return max(int(fixed), 1)
    return max(SCORE_TILE_BYTES // (4 * max(num_heads, 1) * max(num_keys, 1)), 1)


def attend_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos0: int,
    k_pos0: int,
    scale: float,
    window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
    chunk: Optional[int] = None,
) -> torch.Tensor:
    """Causal attention of one sequence's queries over its keys, in query chunks.

    ``q [Q, H, Dk]`` are the queries at positions ``q_pos0 .. q_pos0 + Q - 1``; ``k [S, Hk, Dk]``,
    ``v [S, Hk, Dv]`` the keys/values at positions ``k_pos0 .. k_pos0 + S - 1``, which must cover every
    position a query sees (``k_pos0 + S == q_pos0 + Q``).  Query at ``p`` sees keys ``j <= p`` and, with a
    ``window`` W, ``j > p - W``; ``sinks`` (float ``[H]``) join each head's softmax denominator.  Query head
    ``h`` reads kv head ``h // (H // Hk)``.  All float32; returns ``[Q, H, Dv]``.
    """
    Q, H, Dk = q.shape
    S, Hk, Dv = v.shape
    if k_pos0 + S != q_pos0 + Q:
        raise ValueError(f"keys end at {k_pos0 + S}, queries at {q_pos0 + Q}: the keys must cover the queries")
    qt = q.transpose(0, 1)  # [H, Q, Dk]
    kt = k.transpose(0, 1).contiguous()  # [Hk, S, Dk]
    vt = v.transpose(0, 1).contiguous()  # [Hk, S, Dv]
    if sinks is not None:
        # one extra dim: q carries sink/scale, a trailing zero key carries 1 -> its logit is exactly the sink
        pad = 8
        qe = torch.zeros(H, Q, Dk + pad, dtype=q.dtype, device=q.device)
        qe[..., :Dk] = qt
        qe[..., Dk] = (sinks.to(q.device, torch.float32) / scale)[:, None]
        ke = torch.zeros(Hk, S + 1, Dk + pad, dtype=k.dtype, device=k.device)
        ke[:, :S, :Dk] = kt
        ke[:, S, Dk] = 1.0
        ve = torch.zeros(Hk, S + 1, max(Dv, Dk + pad), dtype=v.dtype, device=v.device)
        ve[:, :S, :Dv] = vt
        qt, kt, vt = qe, ke, ve
    out = torch.empty(Q, H, Dv, dtype=q.dtype, device=q.device)
    C = query_chunk(H, S, chunk)
    gqa = Hk != H
    for i0 in range(0, Q, C):
        i1 = min(Q, i0 + C)
        p_lo, p_hi = q_pos0 + i0, q_pos0 + i1 - 1
        j_lo = k_pos0 if window is None else max(k_pos0, p_lo - int(window) + 1)
        j_hi = p_hi + 1  # exclusive: causal reach of the chunk's last query
        a, b = j_lo - k_pos0, j_hi - k_pos0
        ks, vs = kt[:, a:b], vt[:, a:b]
        mask = None
        if i1 - i0 > 1:  # a single query sees every key of its slice
            qp = torch.arange(p_lo, p_hi + 1, device=q.device)[:, None]
            kp = torch.arange(j_lo, j_hi, device=q.device)[None, :]
            mask = kp <= qp
            if window is not None:
                mask &= kp > qp - int(window)
        if sinks is not None:
            ks = torch.cat((ks, kt[:, S:]), dim=1)
            vs = torch.cat((vs, vt[:, S:]), dim=1)
            if mask is not None:
                mask = torch.cat((mask, torch.ones(i1 - i0, 1, dtype=torch.bool, device=q.device)), dim=1)
        o = F.scaled_dot_product_attention(qt[None, :, i0:i1], ks[None], vs[None], attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[i0:i1] = o[0, :, :, :Dv].transpose(0, 1)
    return out


@dataclass
class TorchPlan:
    """Per-step host view of the batch (``meta.extra["torch"]``), shared by the MHA and MLA paths.

    ``from_cache[b]``: sequence ``b`` reads all its K/V from the pages (decode, a mixed step's decode rows,
    round-trip); otherwise its new tokens' K/V come from the step's compute-precision tensors and only the
    prefix is read."""

    B: int
    cu: list[int]
    seq_lens: list[int]
    q_lens: list[int]
    from_cache: list[bool]
    table: torch.Tensor  # int64 [B, P]
    page_size: int
    _reads: dict = field(default_factory=dict)
    group_tables: list = field(default_factory=list)  # int64 [B, P] per layer group (meta.group_page_tables)

    @property
    def prefixes(self) -> list[int]:
        return [s - q for s, q in zip(self.seq_lens, self.q_lens)]

    def reads(self, window: Optional[int], group: int = 0) -> tuple[torch.Tensor, list[int], list[int], list[int]]:
        """Cache positions a layer with this window must read: ``(slots [N], offsets, lo, n)``; sequence
        ``b`` reads positions ``lo[b] .. lo[b] + n[b] - 1``, rows ``offsets[b] ..`` of the gathered K/V.
        Keys below the first query's window are skipped.  Cached per window (and layer group) for the step."""
        hit = self._reads.get((window, group))
        if hit is not None:
            return hit
        los, ns, offs = [], [], []
        o = 0
        for b in range(self.B):
            pre = self.seq_lens[b] - self.q_lens[b]
            hi = self.seq_lens[b] if self.from_cache[b] else pre
            lo = 0 if window is None else max(0, pre - int(window) + 1)
            lo = min(lo, hi)
            los.append(lo)
            ns.append(hi - lo)
            offs.append(o)
            o += hi - lo
        table = self.group_tables[group] if group else self.table
        dev = table.device
        if o:
            n_t = torch.tensor(ns, device=dev)
            seg = torch.repeat_interleave(torch.arange(self.B, device=dev), n_t)
            start = torch.tensor(offs, device=dev)[seg]
            pos = torch.arange(o, device=dev) - start + torch.tensor(los, device=dev)[seg]
            slots = table[seg, pos // self.page_size] * self.page_size + pos % self.page_size
        else:
            slots = torch.zeros(0, dtype=torch.int64, device=dev)
        hit = (slots, offs, los, ns)
        self._reads[(window, group)] = hit
        return hit


def make_plan(meta: AttentionMetadata) -> TorchPlan:
    """The step's ``TorchPlan`` (host lists from the metadata, or one copy of the device tensors when the
    caller gave none)."""
    B = meta.num_seqs
    cu = [int(x) for x in meta.cu_seqlens_q.tolist()]
    seq_lens = list(meta.seq_lens_cpu) if meta.seq_lens_cpu else [int(x) for x in meta.seq_lens.tolist()]
    q_lens = list(meta.q_lens_cpu) if meta.q_lens_cpu else [cu[b + 1] - cu[b] for b in range(B)]
    rt = list(meta.roundtrip_seqs_cpu) if meta.roundtrip_seqs_cpu else [False] * B
    if len(rt) != B:
        raise ValueError(f"roundtrip_seqs_cpu has {len(rt)} entries for {B} sequences")
    n_dec = meta.decode_rows if meta.phase == "prefill" else 0  # a mixed step's decode rows: the decode path
    from_cache = [meta.phase == "decode" or bool(r) or b < n_dec for b, r in enumerate(rt)]
    return TorchPlan(B, cu, seq_lens, q_lens, from_cache, meta.page_table.to(torch.int64), meta.page_size,
                     group_tables=[t.to(torch.int64) for t in meta.group_page_tables])


def seq_kv(plan: TorchPlan, b: int, gathered: torch.Tensor, offs: list[int], ns: list[int], new: torch.Tensor) -> torch.Tensor:
    """Sequence ``b``'s keys (or values) for its visible positions: the gathered cache rows, followed by its
    new tokens' compute-precision rows unless it reads everything from the cache."""
    part = gathered[offs[b] : offs[b] + ns[b]]
    if plan.from_cache[b]:
        return part
    return torch.cat((part, new[plan.cu[b] : plan.cu[b + 1]].float()), dim=0)
