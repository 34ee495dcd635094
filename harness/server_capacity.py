"""KV capacity of an external server, read from its start-up log (and its ``/metrics``), in the keys of the
embedded engine's ``capacity.json`` (``runtime/engine_api.py`` ``CapacityReport``: ``kv_dtype``,
``page_size``, ``num_pages``, ``tokens``, ``bytes_per_token``, ``kv_bytes``, ``context_len``,
``max_concurrency``) plus ``source``, ``engine`` and the raw figures the server printed.

What the engines print (read in their public source; the line shapes, not the code, are reproduced here):

* SGLang (``python/sglang/srt/mem_cache/memory_pool.py``, every TP rank)::

      [2025-11-04 05:27:13 TP0] KV Cache is allocated. #tokens: 524288, K size: 8.58 GB, V size: 8.58 GB
      [2025-11-04 05:27:13 DP0 TP0 EP0] KV Cache is allocated. #tokens: 524288, KV size: 17.16 GB   (MLA pool)

  (``GB`` there is 2**30 bytes, sizes per rank) and, from the scheduler
  (``python/sglang/srt/managers/scheduler.py``; rank 0 only in 0.4+, every rank before; older lines lack
  ``chunked_prefill_size`` and ``available_gpu_mem``, the oldest print ``[gpu=0]`` / ``[gpu_id=0]``)::

      max_total_num_tokens=524288, chunked_prefill_size=8192, max_prefill_tokens=16384,
      max_running_requests=4096, context_len=131072, available_gpu_mem=12.34 GB

  plus ``server_args=ServerArgs(..., kv_cache_dtype='fp8_e4m3', tp_size=2, page_size=1, ...)``.
* vLLM V1 (``vllm/v1/core/kv_cache_utils.py`` ``_report_kv_cache_config``, ``info_once``), V0
  (``vllm/executor/*_executor.py`` ``initialize_cache``) and the stat logger
  (``vllm/v1/metrics/loggers.py`` ``log_engine_initialized``)::

      (EngineCore_DP0 pid=258) INFO 08-20 10:00:00 [kv_cache_utils.py:1087] GPU KV cache size: 437,104 tokens
      ... Maximum concurrency for 32,768 tokens per request: 13.34x
      INFO 10-01 12:00:05 gpu_executor.py:122] # GPU blocks: 27319, # CPU blocks: 2048     (V0; later "# cuda blocks")
      ... Maximum concurrency for 4096 tokens per request: 106.71x                          (V0: no thousands separator)
      ... Engine 000: vllm cache_config_info with initialization after num_gpu_blocks is: 27319
      ... Available KV cache memory: 4.80 GiB                                                (gpu_worker.py, per worker)
      ... Initializing a V1 LLM engine (v0.10.1) with config: model='...', max_seq_len=32768, ...,
          tensor_parallel_size=1, ..., kv_cache_dtype=fp8, ...
      ... non-default args: {'model_tag': '...', 'kv_cache_dtype': 'fp8', 'max_num_seqs': 64}

  A newer merged form (``GPU KV cache size: N tokens, Maximum concurrency for L tokens per request: X.XXx``)
  is read as well.
* ``kvbench serve`` (``CapacityReport.log_line``): ``KV cache: 41424 tokens (nvfp4, 0.250 GiB), max
  concurrency 17 at context 2304``, then ``scheduler: max running 64, max batched tokens 8192`` (its admission limit).
* ``/metrics``: ``vllm:cache_config_info{block_size="16",cache_dtype="fp8",num_gpu_blocks="27319",...} 1.0``
  (``log_metrics_info``; 0.26 adds ``kv_cache_size_tokens`` and ``kv_cache_memory_bytes``); SGLang ``sglang:max_total_num_tokens`` and ``cache_config_info{page_size, num_pages}``
  (``python/sglang/srt/metrics/collector.py``).

Lines may carry ANSI colours, logger prefixes and rank tags; a log holding several launches (kvbench writes a
``$ <command>`` line before each) is read from its last launch.  Tensor-parallel ranks that print the same
line are read once (the smallest pool wins); data-parallel ranks (``DP<n>`` tags) each own a pool, so their
token counts add up.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

__all__ = ["parse_startup_log", "parse_metrics_capacity", "merge_capacity", "sniff_engine", "server_capacity",
           "read_log_since"]

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_NUM = r"(\d{1,3}(?:,\d{3})+|\d+)"
_FLOAT = r"(\d+(?:\.\d+)?)"
_DP_TAG = re.compile(r"\bDP(\d+)\b|EngineCore_DP(\d+)")

# SGLang
_SGL_ALLOC = re.compile(r"KV Cache is allocated\.(?:\s*dtype:\s*[\w.]+,)?\s*#tokens:\s*" + _NUM +
                        r"(?:,\s*K size:\s*" + _FLOAT + r"\s*GB,\s*V size:\s*" + _FLOAT + r"\s*GB|,\s*KV size:\s*" +
                        _FLOAT + r"\s*GB)?")
_SGL_TOTAL = re.compile(r"max_total_num_tokens?=(\d+)")
_SGL_KEYS = {k: re.compile(rf"\b{k}=(-?\d+)") for k in
             ("chunked_prefill_size", "max_prefill_tokens", "max_prefill_num_token", "max_running_requests",
              "context_len")}
_SGL_AVAIL = re.compile(r"available_(?:gpu|cpu)_mem=" + _FLOAT + r"\s*GB")
_SGL_ARGS = re.compile(r"server_args=ServerArgs\((.*)\)")
# vLLM
_VLLM_TOKENS = re.compile(r"\b(?:GPU|CPU|XPU|HPU|NPU|TPU|Spyre)\s+KV cache size:\s*" + _NUM + r"\s*tokens")
_VLLM_CONC = re.compile(r"Maximum concurrency for\s*" + _NUM + r"\s*tokens per request:\s*" + _FLOAT + r"x")
_VLLM_V0_BLOCKS = re.compile(r"#\s*(?:GPU|cuda|xpu|hpu|npu|rocm|tpu)\s+blocks:\s*" + _NUM, re.IGNORECASE)
_VLLM_INIT_BLOCKS = re.compile(r"num_gpu_blocks is:\s*" + _NUM)
_VLLM_KV_MEM = re.compile(r"Available KV cache memory:\s*(-?\d+(?:\.\d+)?)\s*GiB")
_VLLM_CONFIG = re.compile(r"Initializing an? (V1 )?LLM engine \(v([\w.+-]+)\) with config: (.*)")
_VLLM_VERSION = re.compile(r"(?:vLLM API server version|[\u2580-\u259f]\s+version)\s+([\w.+-]+)")  # 0.26: an ASCII-art banner
_VLLM_ARGS = re.compile(r"non-default args: (\{.*\})")  # vllm/entrypoints/utils.py log_non_default_args
_BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)  # vLLM's BlockSize choices
# kvbench serve
_KVB_LINE = re.compile(r"KV cache:\s*(\d+) tokens \(([\w.]+),\s*" + _FLOAT + r"\s*GiB\),\s*max concurrency\s*(\d+)"
                       r"\s*at context\s*(\d+)")
_KVB_RUNNING = re.compile(r"scheduler: max running (\d+)")

# what only that engine prints, then its bare name
_MARKERS = (
    ("sglang", ("KV Cache is allocated", "max_total_num_token", "server_args=ServerArgs")),
    ("vllm", ("KV cache size:", "# GPU blocks", "# cuda blocks", "Maximum concurrency for", "vLLM API server",
              "LLM engine (v", "Starting vLLM server")),
)


def _int(s: str) -> int:
    return int(s.replace(",", ""))


def _clean(text: str) -> list[str]:
    return _ANSI.sub("", text).replace("\r", "\n").splitlines()


def _last_launch(text: str) -> str:
    """The part of a log written by its last launch (kvbench writes ``$ <command>`` before each)."""
    lines = text.splitlines(keepends=True)
    starts = [i for i, ln in enumerate(lines) if ln.startswith("$ ")]
    return "".join(lines[starts[-1]:]) if starts else text


def sniff_engine(text: str) -> Optional[str]:
    """``sglang`` | ``vllm`` | ``kvbench`` from the log's own lines, None when nothing is recognized."""
    clean = _ANSI.sub("", text)
    for engine, markers in _MARKERS:
        if any(m in clean for m in markers):
            return engine
    if _KVB_LINE.search(clean):
        return "kvbench"
    low = clean.lower()
    for engine in ("sglang", "vllm"):
        if engine in low:
            return engine
    return None


def _dp(line: str) -> str:
    m = _DP_TAG.search(line)
    return (m.group(1) or m.group(2)) if m else ""


def _per_dp_min(pairs: list[tuple[str, float]]):
    """Figures tagged by data-parallel rank: the smallest per rank (TP duplicates), summed over ranks."""
    if not pairs:
        return None
    best: dict[str, float] = {}
    for dp, v in pairs:
        best[dp] = min(v, best.get(dp, v))
    return sum(best.values())


def _server_args(args: str) -> dict:
    """The capacity-relevant fields of SGLang's ``server_args=ServerArgs(...)`` line."""
    out: dict = {}
    for key in ("kv_cache_dtype", "tp_size", "dp_size", "page_size"):
        m = re.search(rf"\b{key}=('?)([\w.]+)\1", args)
        if m and m.group(2) != "None":
            out[key] = int(m.group(2)) if m.group(2).isdigit() else m.group(2)
    return out


def _sglang(lines: list[str]) -> Optional[dict]:
    raw: dict = {}
    allocs: list[tuple[str, int]] = []
    kv_gb: dict[str, float] = {}
    totals: list[tuple[str, int]] = []
    ranks: set[str] = set()
    for ln in lines:
        if m := _SGL_ARGS.search(ln):
            raw.update(_server_args(m.group(1)))
        if m := _SGL_ALLOC.search(ln):
            tag = _dp(ln)
            allocs.append((tag, _int(m.group(1))))
            rank = re.search(r"\bTP(\d+)\b", ln)
            key = f"{tag}/{rank.group(1) if rank else len(ranks)}"
            ranks.add(key)
            sizes = [float(g) for g in m.groups()[1:] if g is not None]
            if sizes:
                kv_gb[key] = sum(sizes)
        if m := _SGL_TOTAL.search(ln):
            totals.append((_dp(ln), int(m.group(1))))
            for k, rx in _SGL_KEYS.items():
                if (v := rx.search(ln)) is not None:
                    raw["max_prefill_tokens" if k == "max_prefill_num_token" else k] = int(v.group(1))
            if v := _SGL_AVAIL.search(ln):
                raw["available_gpu_mem_gb"] = float(v.group(1))
    total = _per_dp_min(totals)
    alloc = _per_dp_min(allocs)
    tokens = total if total is not None else alloc
    if tokens is None:
        return None
    out: dict = {"engine": "sglang", "tokens": tokens}
    if total is not None:
        out["max_total_num_tokens"] = total
    if alloc is not None:
        out["kv_pool_tokens"] = alloc
    out.update(raw)
    page = out.get("page_size")
    if isinstance(page, int) and page > 0:
        out["num_pages"] = tokens // page
    if kv_gb:
        out["kv_bytes"] = int(round(sum(kv_gb.values()) * 2**30))
        out["kv_bytes_ranks"] = len(kv_gb)
    if "context_len" in out and out["context_len"] > 0:
        out["max_concurrency"] = tokens // out["context_len"]
    return out


def _vllm(lines: list[str]) -> Optional[dict]:
    out: dict = {"engine": "vllm"}
    tokens: list[tuple[str, int]] = []
    blocks: list[tuple[str, int]] = []
    concs: list[tuple[str, float]] = []
    kv_gib: list[float] = []
    for ln in lines:
        if m := _VLLM_CONFIG.search(ln):
            out["version"], out["v1"] = m.group(2), bool(m.group(1))
            cfg = m.group(3)
            for key, name in (("max_seq_len", "max_model_len"), ("tensor_parallel_size", "tp_size"),
                              ("pipeline_parallel_size", "pp_size"), ("data_parallel_size", "dp_size")):
                if v := re.search(rf"\b{key}=(\d+)", cfg):
                    out[name] = int(v.group(1))
            if v := re.search(r"\bkv_cache_dtype=([\w.]+)", cfg):
                out["kv_cache_dtype"] = v.group(1)
        elif (m := _VLLM_VERSION.search(ln)) and "version" not in out:
            out["version"] = m.group(1)
        elif m := _VLLM_ARGS.search(ln):
            if v := re.search(r"'max_num_seqs': (\d+)", m.group(1)):
                out["max_num_seqs"] = int(v.group(1))  # the admission limit (running requests), when set
            if (v := re.search(r"'kv_cache_dtype': '([\w.]+)'", m.group(1))) and "kv_cache_dtype" not in out:
                out["kv_cache_dtype"] = v.group(1)
        if m := _VLLM_TOKENS.search(ln):
            tokens.append((_dp(ln), _int(m.group(1))))
        if m := _VLLM_CONC.search(ln):
            out["max_model_len"] = _int(m.group(1))
            concs.append((_dp(ln), float(m.group(2))))
        if m := (_VLLM_V0_BLOCKS.search(ln) or _VLLM_INIT_BLOCKS.search(ln)):
            blocks.append((_dp(ln), _int(m.group(1))))
        if m := _VLLM_KV_MEM.search(ln):
            kv_gib.append(float(m.group(1)))
    n_tokens = _per_dp_min(tokens)
    n_blocks = min(v for _, v in blocks) if blocks else None
    if n_tokens is None and n_blocks is None:
        return None
    if n_blocks is not None:
        out["num_gpu_blocks"] = out["num_pages"] = n_blocks
    conc = _per_dp_min(concs)  # each data-parallel engine serves its own requests: their concurrencies add up
    if conc is not None:
        out["max_concurrency_at_len"] = round(conc, 2)
    if n_tokens is None and conc is not None and out.get("max_model_len"):
        # V0 prints blocks and concurrency = blocks * block_size / max_model_len (2 decimals): recover the block size
        approx = conc * out["max_model_len"]
        bs = round(approx / n_blocks) if n_blocks else 0
        n_tokens = n_blocks * bs if bs in _BLOCK_SIZES else int(round(approx))
    if n_tokens is not None:
        out["tokens"] = n_tokens
        if n_blocks and n_tokens % n_blocks == 0 and len({dp for dp, _ in tokens}) <= 1:
            out["block_size"] = out["page_size"] = n_tokens // n_blocks
    if out.get("max_model_len"):
        out["context_len"] = out["max_model_len"]
    if conc is not None:
        out["max_concurrency"] = int(conc)
    if kv_gib and min(kv_gib) > 0:
        out["kv_cache_memory_gib"] = min(kv_gib)
        workers = out.get("tp_size", 1) * out.get("pp_size", 1) * max(1, len({dp for dp, _ in tokens}))
        out["kv_bytes"] = int(round(min(kv_gib) * 2**30 * workers))
    return out


def _kvbench(lines: list[str]) -> Optional[dict]:
    for ln in reversed(lines):
        if m := _KVB_LINE.search(ln):
            out = {"engine": "kvbench", "tokens": int(m.group(1)), "kv_cache_dtype": m.group(2),
                   "kv_bytes": int(round(float(m.group(3)) * 2**30)), "max_concurrency": int(m.group(4)),
                   "context_len": int(m.group(5))}
            running = next((r for r in map(_KVB_RUNNING.search, lines) if r), None)
            if running:  # the scheduler's admission limit (--max-running)
                out["max_running_requests"] = int(running.group(1))
            return out
    return None


_PARSERS = {"sglang": _sglang, "vllm": _vllm, "kvbench": _kvbench}


def parse_startup_log(text: str, engine_kind: Optional[str] = None, kv_dtype: Optional[str] = None) -> Optional[dict]:
    """Capacity from a server's start-up log; None when the log holds no capacity line.

    ``engine_kind`` ``sglang`` | ``vllm`` | ``kvbench`` picks the parser; None or ``generic`` sniffs it from
    the text.  ``kv_dtype`` (the cell's format name) fills ``kv_dtype``; the server's own name for it, when
    printed, is kept as ``kv_cache_dtype``.  ``bytes_per_token`` is derived from ``kv_bytes / tokens``."""
    text = _last_launch(text or "")
    lines = _clean(text)
    kind = engine_kind if engine_kind in _PARSERS else None
    order = [kind] if kind else ([sniff_engine(text)] if sniff_engine(text) else []) + list(_PARSERS)
    out = None
    for name in dict.fromkeys(k for k in order if k):
        out = _PARSERS[name](lines)
        if out is not None:
            break
    if out is None:
        return None
    out["source"] = "server log"
    if kv_dtype is not None:
        out["kv_dtype"] = kv_dtype
    elif out.get("kv_cache_dtype"):
        out["kv_dtype"] = out["kv_cache_dtype"]
    if out.get("kv_bytes") and out.get("tokens"):
        out["bytes_per_token"] = round(out["kv_bytes"] / out["tokens"], 3)
    return out


# --------------------------------------------------------------------------------------------- /metrics
_PROM_LINE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics_capacity(text: str) -> dict:
    """Capacity figures a server exports on ``/metrics`` (empty dict when none)."""
    out: dict = {}
    for line in (text or "").splitlines():
        m = _PROM_LINE.match(line.strip())
        if not m:
            continue
        name, labels, value = m.group(1), dict(_LABEL.findall(m.group(2) or "")), m.group(3)
        if name == "vllm:cache_config_info":
            for key, label in (("num_gpu_blocks", "num_gpu_blocks"), ("block_size", "block_size")):
                if labels.get(label, "").isdigit():
                    out[key] = int(labels[label])
            if labels.get("cache_dtype"):
                out["kv_cache_dtype"] = labels["cache_dtype"]
            # 0.26 labels the pool itself: kv_cache_size_tokens, kv_cache_memory_bytes (when given), max concurrency
            if labels.get("kv_cache_size_tokens", "").isdigit():
                out["tokens"] = int(labels["kv_cache_size_tokens"])
            if labels.get("kv_cache_memory_bytes", "").isdigit():
                out["kv_bytes"] = int(labels["kv_cache_memory_bytes"])
        elif name in ("cache_config_info", "sglang:cache_config_info"):
            for key in ("page_size", "num_pages"):
                if labels.get(key, "").isdigit():
                    out[key] = int(labels[key])
        elif name == "sglang:max_total_num_tokens":
            try:
                out["max_total_num_tokens"] = int(float(value))
            except ValueError:
                pass
    if "num_gpu_blocks" in out and "block_size" in out:
        out.setdefault("tokens", out["num_gpu_blocks"] * out["block_size"])
        out["num_pages"], out["page_size"] = out["num_gpu_blocks"], out["block_size"]
    if "max_total_num_tokens" in out:
        out.setdefault("tokens", out["max_total_num_tokens"])
    return out


def merge_capacity(from_log: Optional[dict], from_metrics: Optional[dict], kv_dtype: Optional[str] = None) -> Optional[dict]:
    """The log's capacity with the gaps filled from ``/metrics`` (which also appear under ``metrics``)."""
    if not from_metrics:
        return from_log
    base = dict(from_log or {"source": "server metrics"})
    for k, v in from_metrics.items():
        base.setdefault(k, v)
    if from_log is not None:
        base["source"] = "server log+metrics"
    if kv_dtype is not None:
        base["kv_dtype"] = kv_dtype
    elif "kv_dtype" not in base and base.get("kv_cache_dtype"):
        base["kv_dtype"] = base["kv_cache_dtype"]
    if base.get("kv_bytes") and base.get("tokens") and "bytes_per_token" not in base:
        base["bytes_per_token"] = round(base["kv_bytes"] / base["tokens"], 3)
    if base.get("tokens") and base.get("context_len") and "max_concurrency" not in base:
        base["max_concurrency"] = base["tokens"] // base["context_len"]
    base["metrics"] = dict(from_metrics)
    return base


def read_log_since(path: Optional[Path], offset: int = 0) -> str:
    if path is None or not Path(path).exists():
        return ""
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode("utf-8", errors="replace")


def server_capacity(log_path: Optional[Path], base_url: Optional[str] = None, engine_kind: Optional[str] = None,
                    kv_dtype: Optional[str] = None, offset: int = 0, api_key: Optional[str] = None,
                    timeout_s: float = 5.0) -> Optional[dict]:
    """A launched server's capacity: its log from ``offset`` (where this launch began) and, when
    ``base_url`` is given, one ``GET /metrics``.  Never raises; None when neither names a capacity."""
    try:
        cap = parse_startup_log(read_log_since(log_path, offset), engine_kind, kv_dtype)
    except Exception:  # noqa: BLE001 - a log we cannot read costs the capacity figures, not the cell
        cap = None
    metrics: dict = {}
    if base_url:
        try:
            import httpx

            headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
            r = httpx.get(f"{base_url.rstrip('/')}/metrics", headers=headers, timeout=timeout_s)
            if r.status_code == 200:
                metrics = parse_metrics_capacity(r.text)
        except Exception:  # noqa: BLE001 - a server without /metrics is fine
            metrics = {}
    from kvbench.harness.server_admission import admission_limit

    return admission_limit(merge_capacity(cap, metrics, kv_dtype))
