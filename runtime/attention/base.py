"""Attention backend protocol and the per-step metadata every backend reads.

The model calls one backend per layer with **pre-RoPE** ``q``, ``k``, ``v``; the backend applies RoPE,
quantizes and appends the new K/V to the paged cache (``runtime/kv_cache.py`` layout) and computes
attention, returning ``[T, num_heads * head_dim]``.  Doing the three in one call is what lets a backend
fuse them (docs/design.md §6, "fused append").

Semantics shared by every backend (so they agree on numbers):

* ``phase == "prefill"`` (prefill, chunked prefill, extend): the new tokens of a sequence attend causally
  to its cached prefix, read from the (quantized) pages, and to their own K/V in compute precision (not
  round-tripped through the cache format).  The new K/V are appended to the cache in the same call.
* ``phase == "decode"``: every sequence has exactly one new token; it is appended first and then every
  K/V, the new one included, is read from the pages.
* Round-trip sequences (``AttentionMetadata.roundtrip_seqs_cpu[b]`` true, prefill phase only): the new
  tokens of sequence ``b`` attend to their own K/V **as stored** (the format's quantize -> dequantize
  round trip, read back after this step's append), exactly as token-by-token decode would read them.  This
  is how teacher-forced scoring runs a continuation as one extend with decode semantics.  A sequence's
  rows in one step are all round-trip or none (the scheduler never puts the context/continuation
  boundary inside a chunk); other sequences of the same step keep the plain prefill semantics.
* RoPE is applied before quantization.  Sliding window ``W``: a query at position ``p`` sees keys at
  positions ``j`` with ``p - W < j <= p``.  Sinks: one learned logit per query head that joins the
  softmax denominator only (GPT-OSS).
* ``quantize_query`` (``BackendOptions``; ``"none" | "prefill" | "decode" | "both"``): q is rounded through
  float8_e4m3fn (dequant multiplier ``layer.q_scale``) after RoPE, in the phases the mode names.  Prefill
  covers every prefill / chunked-prefill / prefix-cache extend row; decode covers decode steps **and the
  rows of round-trip sequences** (a scored continuation behaves as decode would, so its queries follow the
  decode setting).  ``query_fp8(opts, meta)`` says, per step, which rows are quantized.
* Mixed steps (``EngineConfig.mixed_prefill``; ``AttentionMetadata.decode_rows`` > 0, prefill phase): the
  step's first ``decode_rows`` sequences are decode rows, one new token each at rows ``0 .. decode_rows - 1``,
  with decode semantics.  They are also flagged round-trip, so a backend that runs the whole step as one
  extend (MLA layers, flashinfer) gives them decode semantics that way.  The torch, triton and hybrid backends
  split the step instead (``mixed.mixed_parts``): every row's K/V is appended first, then the decode rows go through
  the backend's decode path (a pure decode step's metadata over those rows) and the other rows through its
  prefill path (a pure prefill step over the rest, its own round-trip rows included), into one output.

Token layout of a step: the new tokens of sequence ``b`` are rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``
of ``q``/``k``/``v``; their positions are ``seq_lens[b] - q_len_b ... seq_lens[b] - 1``.  Rows past
``cu_seqlens_q[-1]`` (CUDA-graph padding) have ``slot_mapping == -1`` and their outputs are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Optional, Protocol, runtime_checkable

from kvbench.core import PHASES

if TYPE_CHECKING:  # torch is imported lazily by the modules that run kernels
    import torch

    from kvbench.runtime.kv_cache import PagedKVCache

__all__ = [
    "PHASES",
    "RopeCache",
    "AttentionLayer",
    "AttentionMetadata",
    "BackendOptions",
    "AttentionBackend",
    "UnsupportedBackend",
    "apply_rope",
    "build_rope_cache",
    "layer_rope",
    "layer_pages",
    "query_fp8",
    "query_fp8_rows",
    "stored_new_kv",
    "to_device",
]


def to_device(data, dtype, device) -> "torch.Tensor":
    """A host list as a tensor on ``device``.  On a GPU through pinned memory and a non-blocking copy: a plain
    ``torch.tensor(data, device=...)`` waits for everything queued on the stream first (the step in flight too,
    runtime/step_outputs.py), which leaves the device idle while the host builds the rest of the step."""
    import torch

    if torch.device(device).type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)



class UnsupportedBackend(ValueError):
    """A (backend, kv format, phase) combination that cannot run; the message lists what can."""


@dataclass
class RopeCache:
    """Rotary tables shared by all layers of a model.

    ``cos``/``sin``: float32 ``[max_positions, rotary_dim // 2]`` on the model's device (scaling such as
    llama3/linear/yarn is already folded in).  ``style``: ``"neox"`` rotates the two halves of the
    rotary dims (x[:d/2], x[d/2:]); ``"interleaved"`` rotates pairs (x[2i], x[2i+1]).  Dims past
    ``rotary_dim`` are left untouched (partial rotary).
    """

    cos: "torch.Tensor"
    sin: "torch.Tensor"
    rotary_dim: int
    style: str = "neox"
    # the tables of the sliding-window (local) layers where they differ (Gemma 3: another base, no scaling);
    # a layer with ``AttentionLayer.local_rope`` rotates with them (``layer_rope``)
    local: Optional["RopeCache"] = None

    def __post_init__(self) -> None:
        if self.style not in ("neox", "interleaved"):
            raise ValueError(f"rope style must be 'neox' or 'interleaved', got {self.style!r}")


@dataclass
class AttentionLayer:
    """Static, per-layer attention description (one instance per model layer)."""

    layer_idx: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    softmax_scale: float
    sliding_window: Optional[int] = None  # None = full attention
    sinks: Optional["torch.Tensor"] = None  # float32 [num_heads] logits, or None
    q_scale: float = 1.0  # dequant multiplier for fp8 q when quantize_query is on
    local_rope: bool = False  # rotates with the step's local tables (``RopeCache.local``), not the global ones


@dataclass
class AttentionMetadata:
    """Everything about one forward step that is the same for all layers.

    All tensors live on the model device.  ``*_cpu`` fields are host copies of the same numbers for
    backends that loop in Python (the torch reference); kernels never need them.
    """

    phase: str  # "prefill" | "decode"
    positions: "torch.Tensor"  # int64 [T] position of every new token
    slot_mapping: "torch.Tensor"  # int64 [T] cache slot of every new token, -1 = skip
    page_table: "torch.Tensor"  # int32 [B, max_pages_per_seq]
    seq_lens: "torch.Tensor"  # int32 [B] tokens in the cache after this step's append
    cu_seqlens_q: "torch.Tensor"  # int32 [B + 1] row offsets of each sequence's new tokens
    max_seqlen_q: int
    max_seqlen_k: int
    page_size: int
    rope: RopeCache
    seq_lens_cpu: list[int] = field(default_factory=list)
    q_lens_cpu: list[int] = field(default_factory=list)
    # decode semantics for some prefill sequences (see the module doc): bool [T] per new-token row (every
    # row of a flagged sequence is True) and the same per sequence on the host; None / [] = no such sequence
    roundtrip_rows: Optional["torch.Tensor"] = None
    roundtrip_seqs_cpu: list[bool] = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # backend-private per-step state (e.g. a flashinfer plan)
    # layer groups (``KVCacheSpec.groups``): each group's page table and slot mapping, group 0's being
    # ``page_table`` / ``slot_mapping``; [] = one page list for every layer (``layer_pages`` picks)
    group_page_tables: list = field(default_factory=list)
    group_slot_mappings: list = field(default_factory=list)
    # a mixed step (prefill phase): its first ``decode_rows`` sequences are decode rows (one token each, also in
    # ``roundtrip_seqs_cpu``); 0 = none.  ``mixed.mixed_parts`` gives the decode and prefill views of the step.
    decode_rows: int = 0

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {self.phase!r}")

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def has_roundtrip(self) -> bool:
        """Some sequence of this (prefill) step reads its new tokens' K/V back from the cache."""
        return self.phase == "prefill" and any(self.roundtrip_seqs_cpu)

    @property
    def prefix_lens_cpu(self) -> list[int]:
        """Cached tokens of each sequence before this step."""
        return [s - q for s, q in zip(self.seq_lens_cpu, self.q_lens_cpu)]


@dataclass
class BackendOptions:
    """How a backend instance is configured (fixed for the engine's lifetime)."""

    kv_dtype: str = "bf16"
    fused_append: bool = True
    quantize_query: "bool | str" = "none"  # none | prefill | decode | both (True/False = both/none)
    device: str = "cpu"
    dtype: str = "float32"  # compute dtype name (torch attribute)
    max_batch_size: int = 64  # for backends that pre-allocate workspaces
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        from kvbench.core import query_quant_phases
        from kvbench.runtime.config import normalize_quantize_query

        self.quantize_query = normalize_quantize_query(self.quantize_query)
        self.query_fp8_prefill, self.query_fp8_decode = query_quant_phases(self.quantize_query)


def query_fp8(opts: BackendOptions, meta: AttentionMetadata) -> "bool | list[bool]":
    """Which queries of this step go through fp8: ``True``/``False`` for every row, or one flag per
    sequence when a prefill step mixes plain rows (prefill setting) with round-trip rows (decode setting)
    and the two settings differ."""
    if meta.phase == "decode":
        return opts.query_fp8_decode
    pre, dec = opts.query_fp8_prefill, opts.query_fp8_decode
    if pre == dec or not meta.has_roundtrip:
        return pre
    flags = [dec if rt else pre for rt in meta.roundtrip_seqs_cpu]
    return flags[0] if len(set(flags)) == 1 else flags


def query_fp8_rows(flags: list[bool], meta: AttentionMetadata, num_rows: int) -> "torch.Tensor":
    """Bool ``[num_rows]`` on the step's device: the rows whose queries go through fp8 for per-sequence
    ``flags`` (from ``query_fp8``); padding rows past ``cu_seqlens_q[-1]`` are False."""
    import torch

    q_lens = list(meta.q_lens_cpu) if meta.q_lens_cpu else torch.diff(meta.cu_seqlens_q).tolist()
    rows = [bool(f) for f, q in zip(flags, q_lens) for _ in range(int(q))]
    rows += [False] * (num_rows - len(rows))
    return to_device(rows, torch.bool, meta.positions.device)


@runtime_checkable
class AttentionBackend(Protocol):
    """One implementation of paged attention.

    ``supports(kv_dtype, phase)`` is a classmethod (checked at start-up, before any weights load);
    ``available()`` says whether the backend can run in this environment (``(False, reason)`` when a
    package or device is missing).  ``plan`` is called once per step before the layers run (may be a
    no-op); ``forward`` once per layer.
    """

    name: ClassVar[str]

    @classmethod
    def supports(cls, kv_dtype: str, phase: str) -> bool: ...

    @classmethod
    def available(cls) -> tuple[bool, str]: ...

    def plan(self, meta: AttentionMetadata, cache: "PagedKVCache") -> None: ...

    def forward(
        self,
        q: "torch.Tensor",  # [T, num_heads, head_dim] pre-RoPE, compute dtype
        k: "torch.Tensor",  # [T, num_kv_heads, head_dim] pre-RoPE
        v: "torch.Tensor",  # [T, num_kv_heads, head_dim]
        layer: AttentionLayer,
        cache: "PagedKVCache",
        meta: AttentionMetadata,
    ) -> "torch.Tensor":  # [T, num_heads * head_dim], compute dtype
        ...


# --------------------------------------------------------------------------------- rope helpers
def build_rope_cache(
    rotary_dim: int,
    max_positions: int,
    base: float = 10000.0,
    scaling: Optional[dict[str, Any]] = None,
    style: str = "neox",
    device: Any = "cpu",
) -> RopeCache:
    """Cos/sin tables with the rope scaling of HF configs folded in (``rope_type`` llama3, linear,
    dynamic (as linear at max length), yarn; None/"default" = plain)."""
    import math

    import torch

    inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    mscale = 1.0
    scaling = dict(scaling or {})
    kind = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        lo, hi = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind == "yarn":
        factor = float(scaling["factor"])
        old = float(scaling.get("original_max_position_embeddings", 4096))
        beta_fast, beta_slow = float(scaling.get("beta_fast", 32)), float(scaling.get("beta_slow", 1))

        def dim_for(rot: float) -> float:
            return rotary_dim * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(dim_for(beta_fast)), 0)
        high = min(math.ceil(dim_for(beta_slow)), rotary_dim - 1)
        ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
        extrap = 1 - ramp
        inv = inv / factor * (1 - extrap) + inv * extrap
        mscale = float(scaling.get("attention_factor") or (0.1 * math.log(factor) + 1.0))
    elif kind in ("dynamic",):
        inv = inv / float(scaling.get("factor", 1.0))
    elif kind != "default":
        raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, linear, dynamic, llama3, yarn")
    t = torch.arange(max_positions, dtype=torch.float64)
    freqs = torch.outer(t, inv)
    cos = (freqs.cos() * mscale).float().to(device)
    sin = (freqs.sin() * mscale).float().to(device)
    return RopeCache(cos=cos, sin=sin, rotary_dim=rotary_dim, style=style)


def layer_pages(meta: AttentionMetadata, cache, layer_idx: int) -> tuple:
    """``(page_table, slot_mapping)`` of layer ``layer_idx`` in this step: its group's under layer groups
    (``cache.spec.group_of``), else the step's one table."""
    g = cache.spec.group_of(layer_idx) if meta.group_page_tables else 0
    if g == 0:
        return meta.page_table, meta.slot_mapping
    return meta.group_page_tables[g], meta.group_slot_mappings[g]


def layer_rope(meta: AttentionMetadata, layer: AttentionLayer) -> RopeCache:
    """The rotary tables ``layer`` uses in this step: the local ones for a local layer, else the global ones."""
    rope = meta.rope
    if layer.local_rope:
        if rope.local is None:
            raise ValueError(f"layer {layer.layer_idx} rotates with local tables but the step has none (RopeCache.local)")
        return rope.local
    return rope


def apply_rope(x: "torch.Tensor", positions: "torch.Tensor", rope: RopeCache) -> "torch.Tensor":
    """Reference RoPE on ``x`` ``[T, H, D]`` (returns a new tensor in x's dtype, math in float32)."""
    import torch

    rd = rope.rotary_dim
    cos = rope.cos[positions].unsqueeze(1)  # [T, 1, rd/2]
    sin = rope.sin[positions].unsqueeze(1)
    xf = x.float()
    rot, rest = xf[..., :rd], xf[..., rd:]
    if rope.style == "neox":
        x1, x2 = rot[..., : rd // 2], rot[..., rd // 2 :]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((out, rest), dim=-1).to(x.dtype)


def stored_new_kv(cache, layer_idx: int, meta: AttentionMetadata, k_new: torch.Tensor, v_new: torch.Tensor):
    """``k_new``/``v_new`` ``[T, H_kv, D]`` with the rows of round-trip sequences (``meta.roundtrip_rows``)
    replaced by their K/V as stored in the pages (dequantized, cast to the inputs' dtypes).  Call after the
    step's append.  Other rows, padding included, keep their compute-precision values."""
    if meta.roundtrip_rows is None:
        return k_new, v_new
    import torch  # lazily, as this module's other helpers
    kk, vv = cache.read_slots(layer_idx, layer_pages(meta, cache, layer_idx)[1], torch.float32)
    m = meta.roundtrip_rows.to(k_new.device)[:, None, None]
    return torch.where(m, kk.to(k_new.dtype), k_new), torch.where(m, vv.to(v_new.dtype), v_new)
