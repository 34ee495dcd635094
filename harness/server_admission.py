"""A server's admission limit on running requests, and the concurrency it leaves: ``admission_limit(cap)``
caps a capacity's ``max_concurrency`` (harness/server_capacity.py) by sglang's ``max_running_requests`` or
vLLM's ``max_num_seqs``, and gives a V1 vLLM that printed none its default for the GPU it runs on.  Measured
on a real vLLM 0.26: docs/external-engines.md "A real vLLM"."""

from __future__ import annotations

import re
from typing import Optional

__all__ = ["admission_limit", "VLLM_DEFAULT_MAX_NUM_SEQS"]

# vLLM V1's admission limit when --max-num-seqs is not given: 1024 for the API server on GPUs with >= 70 GiB
# that are not A100s, 256 otherwise (vllm/engine/arg_utils.py get_batch_defaults, 0.8 through 0.26 at least).
VLLM_DEFAULT_MAX_NUM_SEQS = ((70 * 1024, 1024), (0, 256))


def _first_gpu() -> Optional[dict]:
    import os

    from kvbench.harness.provenance import nvidia_smi

    gpus = nvidia_smi()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if visible.isdigit() and int(visible) < len(gpus):
        return gpus[int(visible)]
    return gpus[0] if gpus else None


def _vllm_v1(cap: dict) -> bool:
    """The server ran vLLM's V1 engine: it said so, or its version is past V0's removal (0.11)."""
    if cap.get("v1") is not None:
        return bool(cap["v1"])
    m = re.match(r"(\d+)\.(\d+)", str(cap.get("version") or ""))
    return bool(m) and (int(m.group(1)), int(m.group(2))) >= (0, 11)


def admission_limit(cap: Optional[dict], gpu: Optional[dict] = None) -> Optional[dict]:
    """Cap ``max_concurrency`` by the server's admission limit (sglang max_running_requests, vLLM max_num_seqs)
    and keep the KV pool's own figure as ``max_concurrency_kv``.  A V1 vLLM that printed no max_num_seqs runs
    with its default, which depends on the GPU (``gpu``: ``{name, memory_mib}``; default: nvidia-smi's first
    visible GPU, the one a launched server uses); ``max_num_seqs_source`` says where the figure came from."""
    if not cap:
        return cap
    if cap.get("engine") == "vllm" and cap.get("max_num_seqs") is None and _vllm_v1(cap):
        gpu = gpu if gpu is not None else _first_gpu()
        if gpu:
            name, mem = str(gpu.get("name", "")), int(gpu.get("memory_mib") or 0)
            limit = next(n for floor, n in VLLM_DEFAULT_MAX_NUM_SEQS if mem >= floor and not (floor and "A100" in name))
            cap["max_num_seqs"] = limit
            cap["max_num_seqs_source"] = f"vLLM's default on {name} ({mem:,} MiB): --max-num-seqs not given"
        else:
            cap["max_num_seqs_source"] = "unknown: --max-num-seqs not given and no GPU seen (vLLM's default is 256 or 1024)"
    elif cap.get("max_num_seqs") is not None:
        cap.setdefault("max_num_seqs_source", "server log")
    limit = next((cap[k] for k in ("max_running_requests", "max_num_seqs") if isinstance(cap.get(k), int) and cap[k] > 0), None)
    if limit is not None and isinstance(cap.get("max_concurrency"), int):
        cap["max_concurrency_kv"] = cap["max_concurrency"]
        cap["max_concurrency"] = min(cap["max_concurrency"], limit)
    return cap
