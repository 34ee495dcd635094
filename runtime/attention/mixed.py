"""Mixed steps (``AttentionMetadata.decode_rows``, ``EngineConfig.mixed_prefill``): a prefill step whose first
sequences are decode rows, cut into a decode step over those rows and a prefill step over the others, for the
backends that run each part through its own kernels (base.py, "Mixed steps")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvbench.runtime.attention.base import AttentionMetadata

__all__ = ["MixedParts", "mixed_parts"]


@dataclass
class MixedParts:
    """A mixed step cut in two (``mixed_parts``): ``decode`` is a decode step over its first ``rows`` sequences
    (rows ``0 .. rows - 1`` of the token batch), ``prefill`` a prefill step over the others (rows ``rows ..``,
    their cu_seqlens_q rebased to 0, their round-trip flags kept).  Each has its own ``extra`` (a backend plans
    each part in it); the tensors are views of the step's, except the rebased cu_seqlens_q."""

    rows: int
    decode: AttentionMetadata
    prefill: AttentionMetadata


def mixed_parts(meta: AttentionMetadata) -> Optional[MixedParts]:
    """The decode and prefill parts of a mixed step (``meta.decode_rows`` > 0 in the prefill phase), built once
    per step (kept in ``meta.extra``); None for any other step."""
    n = meta.decode_rows
    if n <= 0 or meta.phase != "prefill":
        return None
    hit = meta.extra.get("mixed_parts")
    if hit is not None:
        return hit
    B = meta.num_seqs
    q_lens = list(meta.q_lens_cpu) if meta.q_lens_cpu else [int(x) for x in meta.cu_seqlens_q.diff().tolist()]
    if n >= B or any(x != 1 for x in q_lens[:n]):
        raise ValueError(f"a mixed step's {n} decode rows must be one-token sequences before at least one other "
                         f"(q_lens {q_lens[:n + 1]} of {B} sequences)")
    seq_cpu = list(meta.seq_lens_cpu)
    rt = list(meta.roundtrip_seqs_cpu)[n:] if meta.roundtrip_seqs_cpu else []
    dec = AttentionMetadata(
        phase="decode", positions=meta.positions[:n], slot_mapping=meta.slot_mapping[:n],
        page_table=meta.page_table[:n], seq_lens=meta.seq_lens[:n], cu_seqlens_q=meta.cu_seqlens_q[: n + 1],
        max_seqlen_q=1, max_seqlen_k=max(seq_cpu[:n]) if seq_cpu else meta.max_seqlen_k, page_size=meta.page_size,
        rope=meta.rope, seq_lens_cpu=seq_cpu[:n], q_lens_cpu=q_lens[:n],
        group_page_tables=[t[:n] for t in meta.group_page_tables],
        group_slot_mappings=[s[:n] for s in meta.group_slot_mappings],
    )
    pre = AttentionMetadata(
        phase="prefill", positions=meta.positions[n:], slot_mapping=meta.slot_mapping[n:],
        page_table=meta.page_table[n:], seq_lens=meta.seq_lens[n:], cu_seqlens_q=meta.cu_seqlens_q[n:] - n,
        max_seqlen_q=max(q_lens[n:]), max_seqlen_k=max(seq_cpu[n:]) if seq_cpu else meta.max_seqlen_k,
        page_size=meta.page_size, rope=meta.rope, seq_lens_cpu=seq_cpu[n:], q_lens_cpu=q_lens[n:],
        group_page_tables=[t[n:] for t in meta.group_page_tables],
        group_slot_mappings=[s[n:] for s in meta.group_slot_mappings],
    )
    if any(rt):
        pre.roundtrip_seqs_cpu = rt
        pre.roundtrip_rows = meta.roundtrip_rows[n:]
    parts = MixedParts(n, dec, pre)
    meta.extra["mixed_parts"] = parts
    return parts
