"""FlashAttention 3 as vLLM ships it, as a timing anchor: the paged, causal varlen forward of the
``_vllm_fa3_C`` extension in a vLLM wheel (``vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so``, built for sm_90a), the
attention kernel a vLLM server runs on Hopper (``--attention-backend FLASH_ATTN``).

Only that one library is needed, not vLLM: it links against torch and the CUDA runtime alone, and is loaded with
``torch.ops.load_library``.  Where it comes from: ``KVBENCH_VLLM_FA3`` (the ``.so``'s path), else an importable
``vllm`` package's copy (found without importing vllm).  Its operator is called by the argument names of its own
schema (``fwd(q, k, v, ..., page_table, ...)``), so a build whose schema lacks one of them fails with the names,
not a shifted positional call.

Layouts: the pages as FA3 takes them, ``[P, page, H_kv, D]`` with the head dim contiguous (kvbench's HND pages
are copied to that layout once, outside the timing); causal attention aligned to the bottom right (each
sequence's new tokens are its last), as ``paged_prefill``'s.  fp8: FA3 runs e4m3 K / V only with e4m3 queries,
and takes per-(sequence, kv head) float32 descales.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Optional

__all__ = ["ENV", "available", "find_library", "load", "check_schema", "PagedFA3", "causal_row", "extend_row"]

ENV = "KVBENCH_VLLM_FA3"
_REL = Path("vllm_flash_attn") / "_vllm_fa3_C.abi3.so"
_LOADED: dict = {}


def find_library() -> tuple[Optional[Path], str]:
    """(path, "") of the FA3 library, or (None, why not)."""
    env = os.environ.get(ENV)
    if env:
        p = Path(env)
        return (p, "") if p.is_file() else (None, f"{ENV}={env} is not a file")
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None, f"no vllm package and {ENV} unset"
    for loc in spec.submodule_search_locations:
        p = Path(loc) / _REL
        if p.is_file():
            return p, ""
    return None, f"the vllm package has no {_REL}"


def available() -> bool:
    """Whether the library is there and this process has a Hopper GPU (FA3 runs on sm_90 only)."""
    if find_library()[0] is None:
        return False
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def load():
    """The ``torch.ops._vllm_fa3_C`` namespace, the library loaded once; raises RuntimeError saying why not."""
    import torch

    if "ops" in _LOADED:
        return _LOADED["ops"]
    path, why = find_library()
    if path is None:
        raise RuntimeError(f"vLLM's FA3 is not available: {why} (take vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so out of a "
                           f"vllm wheel, e.g. `unzip -j vllm-0.26.0-*.whl '*/_vllm_fa3_C.abi3.so'`, and set {ENV} to "
                           "its path; it needs a Hopper GPU and the torch it was built for)")
    torch.ops.load_library(str(path))
    ops = torch.ops._vllm_fa3_C
    _LOADED.update(ops=ops, path=path, names=check_schema({a.name for a in ops.fwd.default._schema.arguments}, path))
    return ops


NEEDED = frozenset({"q", "k", "v", "out", "cu_seqlens_q", "seqused_k", "max_seqlen_q", "max_seqlen_k", "page_table",
                    "q_descale", "k_descale", "v_descale", "softmax_scale", "is_causal", "window_size_left",
                    "window_size_right", "softcap", "num_splits"})


def check_schema(names: set, path) -> set:
    """``names`` (the fwd operator's argument names) if it has every argument this module passes by name."""
    missing = sorted(NEEDED - set(names))
    if missing:
        raise RuntimeError(f"{path}: its fwd schema lacks {missing} (a different FA3 build)")
    return set(names)


def _defaults(names: set) -> dict:
    """Values for the schema's other arguments: nothing new to append, no rotary, no sinks, no split KV chosen
    here (0: FA3's own heuristic), no context parallelism."""
    d = {"k_new": None, "v_new": None, "q_v": None, "cu_seqlens_k": None, "cu_seqlens_k_new": None,
         "seqused_q": None, "kv_batch_idx": None, "leftpad_k": None, "rotary_cos": None, "rotary_sin": None,
         "seqlens_rotary": None, "is_rotary_interleaved": True, "scheduler_metadata": None, "pack_gqa": None,
         "sm_margin": 0, "s_aux": None, "cp_world_size": 1, "cp_rank": 0, "cp_tot_seqused_k": None}
    return {k: v for k, v in d.items() if k in names}


class PagedFA3:
    """One paged causal problem bound to FA3: ``q`` ``[T, H_q, D]`` packed by ``cu_seqlens_q``, the pages ``k_pages``
    / ``v_pages`` ``[P, page, H_kv, D]`` (any layout with the head dim contiguous: copied to FA3's), ``page_table``
    ``[B, W]`` int32 and ``seq_lens`` ``[B]`` int32 (prefix + new).  fp8 pages need e4m3 queries and the scales:
    ``q_scale`` (one value) and ``k_scale`` / ``v_scale`` (one value, or one per kv head).  ``__call__`` runs it
    into ``out``."""

    def __init__(self, q, k_pages, v_pages, cu_seqlens_q, max_q_len: int, page_table, seq_lens, max_seq_len: int,
                 sm_scale: Optional[float] = None, q_scale=None, k_scale=None, v_scale=None):
        import torch

        self.ops = load()
        fp8 = k_pages.dtype == torch.float8_e4m3fn
        if fp8 and q.dtype != torch.float8_e4m3fn:
            raise ValueError("FA3 runs e4m3 K / V with e4m3 queries only")
        if not fp8 and k_pages.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"FA3 takes bf16 / fp16 or e4m3 pages, got {k_pages.dtype}")
        b = cu_seqlens_q.shape[0] - 1
        hk = k_pages.shape[2]
        self.k, self.v = k_pages.contiguous(), v_pages.contiguous()
        self.out = torch.empty(q.shape, dtype=torch.bfloat16 if fp8 else q.dtype, device=q.device)

        def descale(x):
            if x is None:
                return None
            x = torch.as_tensor(x, dtype=torch.float32, device=q.device).reshape(-1)
            return x.expand(hk).reshape(1, hk).expand(b, hk).contiguous() if x.numel() in (1, hk) else None

        if fp8 and (descale(q_scale) is None or descale(k_scale) is None or descale(v_scale) is None):
            raise ValueError("fp8 needs q_scale, k_scale and v_scale (one value, or one per kv head)")
        self.args = dict(
            _defaults(_LOADED["names"]), q=q, k=self.k, v=self.v, out=self.out, cu_seqlens_q=cu_seqlens_q,
            seqused_k=seq_lens, max_seqlen_q=int(max_q_len), max_seqlen_k=int(max_seq_len), page_table=page_table,
            q_descale=descale(q_scale) if fp8 else None, k_descale=descale(k_scale) if fp8 else None,
            v_descale=descale(v_scale) if fp8 else None,
            softmax_scale=float(sm_scale if sm_scale is not None else q.shape[-1] ** -0.5), is_causal=True,
            window_size_left=-1, window_size_right=-1, softcap=0.0, num_splits=0)

    def __call__(self):
        self.ops.fwd(**self.args)
        return self.out


# ---------------------------------------------------------------------------------- benchmark rows
def _row(name, flops, ours_us, make, pre: Optional[dict] = None, key: str = ""):
    """An anchor row with kvbench's speed-up over it, or why it is missing; with ``pre``, its µs recorded as
    ``pre[key]`` and the same call's CUDA-graph replays as ``pre[key + "_graph"]`` (``common.graph_note``)."""
    from kvbench.tools.common import Row, bench_us, graph_note, speedup

    try:
        fa3 = make()
        t = bench_us(fa3)
    except Exception as e:  # noqa: BLE001 - no anchor: the library refused these inputs
        return Row(f"{name} (failed)", float("nan"), note=f"{type(e).__name__}: {' '.join(str(e).split())[:160]}")
    note = ""
    if pre is not None:
        pre[key] = t
        note = graph_note(pre, key, fa3).lstrip("; ")
    return Row(name, t, tflops=flops / (t * 1e-6) / 1e12, kvbench_x=speedup(t, ours_us), note=note)


def causal_row(pb, n: int, length: int):
    """FA3 on ``PrefillBench`` ``pb``'s causal problem of ``n`` prompts of ``length`` tokens (read from the pages)."""
    from kvbench.tools.common import causal_name

    x = pb.causal_inputs(n, length)
    ours = pb.res.pre.get("triton_us" if n == 1 else f"prompts_{n}x{length}")
    flops = n * 4 * pb.hq * pb.d * length * length / 2
    yield _row(causal_name("vLLM FA3", n, length, pb.hq, pb.hk, pb.d) + " (paged)", flops, ours,
               lambda: PagedFA3(x["q"], x["kc"], x["vc"], x["cu"], length, x["table"], x["lens"], length))


def extend_row(pb, fmt: str, tag: str):
    """FA3 on ``pb``'s extend of ``fmt`` (bf16 queries over bf16 pages; e4m3 queries over e4m3 pages);
    records its µs as ``res.pre["vllm_fa3_extend_<fmt>[_<tag>]"]`` for the targets, and as CUDA-graph replays
    with ``_graph`` after the key."""
    x = pb.extend_inputs(fmt)
    key = f"extend_{fmt}{tag.replace(' ', '_')}"
    fp8 = fmt == "fp8_e4m3"
    qq = x["q8"] if fp8 else x["qx"]
    sc = dict(q_scale=x["qsc"], k_scale=x["ks"], v_scale=x["vs"]) if fp8 else {}
    yield _row(f"{pb._extend_name('vLLM FA3', fmt, tag)} (paged)", pb.fl, pb.res.pre.get(key),
               lambda: PagedFA3(qq, x["kc"], x["vc"], x["cux"], pb.new, x["table"], x["lx"], pb.seq, **sc),
               pb.res.pre, f"vllm_fa3_{key}")
