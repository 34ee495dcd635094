"""The config objects the kernel launchers take, instead of long argument lists.

* ``PagedKV``: one layer's paged K / V cache: format, the two planes, their scales and block scales
  (``append``, ``decode``, ``prefill`` and the float64 references in ``reference.py``);
* ``AttentionParams``: what the layer's attention computes beyond ``softmax(q·kᵀ)·v``: softmax scale, sliding
  window, sinks, and the fp8 query's scale (``paged_decode``, ``paged_prefill``, the references);
* ``DecodeOptions`` / ``PrefillOptions`` / ``MLADecodeOptions`` / ``MLAPrefillOptions``: each launcher's tuning
  knobs (tiles, warps, stages, splits, kernel variants; ``None`` = the launcher's measured default) and the
  host-side sizes that spare it a device sync or pick its defaults.

Plain frozen dataclasses: importing this module imports neither torch nor triton.  The objects holding
tensors compare by identity (``eq=False``); the options compare by value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # annotations only
    import torch

__all__ = ["PagedKV", "AttentionParams", "DecodeOptions", "PrefillOptions", "MLADecodeOptions", "MLAPrefillOptions"]


@dataclass(frozen=True, eq=False)
class PagedKV:
    """One layer's paged K and V cache as the kernels read and write it.

    ``k_cache`` / ``v_cache``: ``[num_pages + 1, page_size, H_kv, Dp]`` in the storage dtype of ``kv_format``
    (token-major NHD, or a head-major HND plane passed as its ``permute(0, 2, 1, 3)``); ``k_scale`` /
    ``v_scale``: fp32 ``[H_kv]`` dequant multipliers (needed by the quantized formats; ``None`` is 1);
    ``k_block_scale`` / ``v_block_scale``: nvfp4's float8_e4m3fn ``[num_pages + 1, page_size, H_kv, D / 16]``,
    laid out like their planes."""

    kv_format: str
    k_cache: "torch.Tensor"
    v_cache: "torch.Tensor"
    k_scale: Optional["torch.Tensor"] = None
    v_scale: Optional["torch.Tensor"] = None
    k_block_scale: Optional["torch.Tensor"] = None
    v_block_scale: Optional["torch.Tensor"] = None


@dataclass(frozen=True, eq=False)
class AttentionParams:
    """The attention a layer computes: ``sm_scale`` (``None``: ``head_dim ** -0.5``), ``sliding_window`` (each
    query sees its last W positions; ``None`` / 0: all), ``sinks`` (one attention-sink logit per query head,
    added to the softmax denominator), and ``q_scale`` (fp32 ``[1]``, the dequant multiplier of a
    float8_e4m3fn query; ``None`` for a query in compute precision)."""

    sm_scale: Optional[float] = None
    sliding_window: Optional[int] = None
    sinks: Optional["torch.Tensor"] = None
    q_scale: Optional["torch.Tensor"] = None


@dataclass(frozen=True)
class DecodeOptions:
    """``paged_decode``'s launch options; ``None`` takes the per-format default (``decode._DEFAULTS``).

    ``num_splits`` (split-K over the context), ``block_n`` (tokens per tile, a power of two >= 16),
    ``num_warps``, ``num_stages``; ``prefetch`` (load the next tile before computing this one); ``units16``
    (fp8 / nvfp4 read as 16-bit units, default on with a float16 dot); ``split_reduce`` (with one split, keep
    the separate reduce kernel); ``maxnreg`` (a register cap per thread, GPU only; 0: none); ``gluon`` (nvfp4
    through ``decode_nv4``'s explicit-layout kernel: ``None`` where it applies and no Triton option is given,
    ``True`` that kernel or a ValueError, ``False`` never)."""

    num_splits: Optional[int] = None
    block_n: Optional[int] = None
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None
    prefetch: Optional[bool] = None
    units16: Optional[bool] = None
    split_reduce: bool = False
    maxnreg: Optional[int] = None
    gluon: Optional[bool] = None


@dataclass(frozen=True)
class PrefillOptions:
    """``paged_prefill``'s launch options; ``None`` takes the default (``prefill.launch_defaults`` for tiles,
    warps and stages).

    ``block_m`` (query rows per program), ``block_n`` (keys per tile over the new tokens; given alone it tiles
    the prefix too), ``block_n_prefix`` (keys per tile over the cached prefix), ``num_warps``, ``num_stages``;
    ``heavy_first`` (the longest causal rows launch first); ``fp8_qk`` (scores over an e4m3 prefix as fp8 dots
    of the stored K; ``False``: convert each K tile); ``prefix_full`` (``False``: mask every prefix tile, the
    old path); ``max_prefix_len`` (host int: the batch's longest cached prefix, at least every sequence's when
    the prefix workspace runs; 0: prompts only; picks the launch defaults and the workspace plan); ``tma``
    (read q and the new tokens through tensor descriptors); ``prefix_workspace`` (dequantize the prefix once
    into a float16 workspace, ``prefill.workspace_plan``); ``wgmma`` (the Hopper kernel of ``prefill_wg.py``; a
    quantized prefix is dequantized into a workspace of q's 16-bit dtype for it first: ``None`` for an extend with
    a cached prefix (``max_prefix_len`` > 0) at head dim 128 where it applies and no Triton kernel option (tiles,
    warps, stages, ``fp8_qk``) is given,
    over a quantized prefix from ``prefill.WGMMA_WORKSPACE_MIN_Q`` new tokens; ``True`` that kernel or a
    ValueError saying why not; ``False`` the Triton kernel)."""

    block_m: Optional[int] = None
    block_n: Optional[int] = None
    block_n_prefix: Optional[int] = None
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None
    heavy_first: bool = True
    fp8_qk: Optional[bool] = None
    prefix_full: bool = True
    max_prefix_len: Optional[int] = None
    tma: Optional[bool] = None
    prefix_workspace: Optional[bool] = None
    wgmma: Optional[bool] = None


@dataclass(frozen=True)
class MLADecodeOptions:
    """``mla_decode``'s launch options; ``None`` takes the default (``mla_decode._defaults``).

    ``num_splits`` (split-K over pages), ``max_seq_len`` (host int: the longest sequence, which sizes the
    default split count; ``None``: read from ``seq_lens``, a device sync), ``block_h``, ``block_n``,
    ``num_warps``, ``num_stages``; kernel variants ``units16``, ``q_split``, ``chunks``, ``fp8_scores``,
    ``wgmma``, ``fp8_pv`` (``mla_decode``'s docstring says what each does and when it is the default)."""

    num_splits: Optional[int] = None
    max_seq_len: Optional[int] = None
    block_h: Optional[int] = None
    block_n: Optional[int] = None
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None
    units16: Optional[bool] = None
    q_split: Optional[bool] = None
    chunks: Optional[int] = None
    fp8_scores: Optional[bool] = None
    wgmma: Optional[bool] = None
    fp8_pv: bool = False


@dataclass(frozen=True)
class MLAPrefillOptions:
    """``mla_prefill``'s launch options; ``None`` takes the default (``mla_prefill._PREFILL_DEFAULTS``).

    ``max_q_len`` (host int: the most new tokens of one sequence, which sizes the grid; ``None``: read from
    ``cu_seqlens_q``, a device sync), ``block_m``, ``heads_per_block``, ``block_n``, ``num_warps``,
    ``num_stages``; ``fp8_scores`` (prefix scores as fp8 dots on the stored latent); ``prefix_workspace`` /
    ``workspace_bytes`` (dequantize the prefix once into a workspace of at most that many bytes);
    ``num_splits`` (split the prefix across programs)."""

    max_q_len: Optional[int] = None
    block_m: Optional[int] = None
    heads_per_block: Optional[int] = None
    block_n: Optional[int] = None
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None
    fp8_scores: Optional[bool] = None
    prefix_workspace: Optional[bool] = None
    workspace_bytes: Optional[int] = None
    num_splits: Optional[int] = None
