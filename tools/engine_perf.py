"""Engine performance checks behind docs/performance.md (run on a GPU; parts run on CPU too).

    python -m kvbench.tools.engine_perf --out perf.json [--model synthetic:llama-3-8b] [--formats ...] [--skip ...]

1. copy bandwidth of the device (read + write bytes of a large tensor copy / time);
2. decode step (forward + logits) of a model at batch B x context L, eager and with CUDA graphs,
   against the roofline (weight bytes + KV bytes) / copy bandwidth; MLA models (``--model
   synthetic:deepseek-v2-lite``) count their latent cache (one ``rank + rope`` plane per layer, scales
   included) as the KV bytes; a graphed step's row carries its ``anatomy`` (``step_anatomy``: host and
   device parts, and the time the device idles) and the step as the engine serves (``served_decode_step``: its own
   loop, steps launched ahead, ``--served-steps``); an eager step's kernels by name (``profile``) and a prefill
   step's (``--prefill SEQSxPROMPT``) by kind, with the GEMMs' TFLOP/s (``prefill``);
3. max concurrent sequences without queueing per KV format at a fixed KV budget (measured from the
   scheduler's running count while requests of a fixed length are served);
4. every KV format x backend pair generates (tokens/s, greedy agreement with bf16 on torch).

Each row is printed (one JSON object after its section's name) as soon as it is measured, with a progress
line on stderr (``streaming.py``); ``--out`` is rewritten after every row.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from kvbench.core import SamplingParams
from kvbench.core import format_names
from kvbench.runtime import EngineConfig
from kvbench.tools.common import bench_formats
from kvbench.tools.engine_measure import (  # noqa: F401 - re-exported: the measurements are this tool's API
    copy_bandwidth,
    decode_step,
    decode_step_times,
    kernel_breakdown,
    peak_concurrency,
    prefill_breakdown,
    served_decode_step,
    step_anatomy,
    weight_bytes_read_per_step,
)
from kvbench.tools.streaming import Step, stream_rows


def generate_check(loaded, fmt: str, pre: str, dec: str, prompts, n_tok: int, device: str, budget_gb: float) -> dict:
    scales = "unit" if fmt in ("bf16", "fp16") else "calibrate"
    cfg = EngineConfig(kv_dtype=fmt, kv_scales=scales, prefill_backend=pre, decode_backend=dec, device=device,
                       kv_budget_gb=budget_gb, max_running=len(prompts), calibration_prompts=8)

    def run(e) -> dict:
        e.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up / capture
        t = time.perf_counter()
        outs = e.generate(prompts, SamplingParams(max_tokens=n_tok, ignore_eos=True))
        dt = time.perf_counter() - t
        ok = all(o.finish_reason == "length" for o in outs)
        return {"tokens": [o.token_ids for o in outs], "tok_s": sum(len(o.token_ids) for o in outs) / dt, "ok": ok,
                "graphs": e.runner.graphs is not None}

    return _with_engine(cfg, run, loaded=loaded)


def iter_format_matrix(model_name, device, prompts_text, n_tok, budget_gb, pairs):
    """Every registered format × (prefill, decode) backend pair: a row each as it is measured (an unsupported
    pair is reported, not hidden)."""
    from kvbench.runtime import load_model

    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    loaded = load_model(model_name, device=device, dtype=dtype)
    prompts = [loaded.tokenizer.encode(t) for t in prompts_text]
    ref = generate_check(loaded, "bf16", "torch", "torch", prompts, n_tok, device, budget_gb)["tokens"]
    for fmt in format_names():
        for pre, dec in pairs:
            try:
                r = generate_check(loaded, fmt, pre, dec, prompts, n_tok, device, budget_gb)
            except Exception as e:  # an unsupported pair is reported, not hidden
                yield {"model": loaded.model_id, "kv": fmt, "backend": f"{pre}+{dec}", "error": f"{type(e).__name__}: {e}"[:200]}
                continue
            same = sum(a == b for a, b in zip(r["tokens"], ref))
            first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), n_tok) for a, b in zip(r["tokens"], ref)]
            yield {"model": loaded.model_id, "kv": fmt, "backend": f"{pre}+{dec}", "ok": r["ok"], "tok_s": round(r["tok_s"], 1),
                   "identical_to_bf16_torch": f"{same}/{len(prompts)}", "mean_first_divergence": round(sum(first) / len(first), 1),
                   "cuda_graphs": r["graphs"]}
    del loaded


def format_matrix(*a, **k) -> list[dict]:
    return list(iter_format_matrix(*a, **k))


def concurrent_check(device: str, n: int = 16, n_tok: int = 256) -> dict:
    """Default model: ``n`` requests of ``n_tok`` greedy tokens at once; all finish, and two of them
    equal the same requests run alone (first divergence reported)."""
    from kvbench.runtime import Engine

    e = Engine(EngineConfig(device=device, kv_budget_gb=0.5, max_running=n))
    try:
        prompts = [e.tokenizer.encode(PROMPTS[i % len(PROMPTS)] + f" ({i})") for i in range(n)]
        p = SamplingParams(max_tokens=n_tok, ignore_eos=True)
        t = time.perf_counter()
        outs = e.generate(prompts, p)
        dt = time.perf_counter() - t
        solo = [e.generate([prompts[i]], p)[0] for i in (0, n - 1)]
        first = [next((j for j, (a, b) in enumerate(zip(o.token_ids, s_.token_ids)) if a != b), n_tok)
                 for o, s_ in zip((outs[0], outs[-1]), solo)]
        return {"requests": n, "tokens_each": n_tok, "all_finished": all(len(o.token_ids) == n_tok for o in outs),
                "seconds": round(dt, 1), "tok_s": round(n * n_tok / dt, 1), "preemptions": e.stats().preemptions,
                "solo_first_divergence": first, "pages_used_after": e.cache.allocator.num_used}
    finally:
        e.shutdown()


PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Question: What is 12 times 7?\nAnswer:",
    "Once upon a time", "The three laws of thermodynamics are", "import numpy as np\n", "List of prime numbers: 2, 3, 5,",
    "Translate to French: good morning",
]


def _parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m kvbench.tools.engine_perf")
    ap.add_argument("--out", default="perf.json")
    ap.add_argument("--model", default="synthetic:llama-3-8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--served-steps", type=int, default=64,
                    help="decode steps per request of the served measure (0: skip it; engine_measure.served_decode_step)")
    ap.add_argument("--decode-backend", default="triton")
    ap.add_argument("--gemm-library", default="cublas", choices=("cublas", "cublaslt", "triton"),
                    help="the linear layers' library (EngineConfig.gemm_library)")
    ap.add_argument("--capacity-budget-gb", type=float, default=2.0)
    ap.add_argument("--formats", default="", help="comma list of KV formats for the decode and profile rows (default: one per element width)")
    ap.add_argument("--prefill", default="8x1024", help="the prefill step the prefill section times: SEQSxPROMPT")
    ap.add_argument("--skip", default="", help="comma list of: bandwidth,decode,anatomy (of the graphed steps),profile,prefill,capacity,matrix,default,concurrent")
    return ap.parse_args(argv)


class _Sections:
    """The measurements of one run: each records its row in ``res`` and returns ``(section, row)`` (``matrix``
    yields them); ``save`` rewrites ``--out``."""

    def __init__(self, args, skip: set) -> None:
        self.args, self.skip = args, skip
        self.res: dict = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                          "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "model": args.model}
        self.pairs: list = []

    def save(self) -> None:
        tmp = self.args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.res, f, indent=1)
        os.replace(tmp, self.args.out)

    def _decode_cfg(self, fmt: str, eager: bool) -> EngineConfig:
        a = self.args
        pre = "triton" if a.device.startswith("cuda") else "torch"  # the served measure's prompts
        return EngineConfig(model=a.model, kv_dtype=fmt, prefill_backend=pre, decode_backend=a.decode_backend,
                            device=a.device, max_running=a.batch, max_model_len=a.ctx + a.served_steps + 16,
                            kv_budget_gb=a.batch * (a.ctx + a.served_steps + 16) * 1.05 * _bpt(a.model, fmt) / 2**30,
                            enforce_eager=eager, gemm_library=a.gemm_library)

    def bandwidth(self):
        self.res["copy_bandwidth_GBs"] = copy_bandwidth(self.args.device) / 1e9
        return ("bandwidth", {"copy_bandwidth_GBs": self.res["copy_bandwidth_GBs"]})

    def _step_row(self, e, fmt: str) -> dict:
        a = self.args
        tt = decode_step_times(e, a.batch, a.ctx)
        t = tt["step_s"]
        wb = weight_bytes_read_per_step(e.runner.model)
        kvb = a.batch * a.ctx * e.cache.bytes_per_token
        row = {"kv": fmt, "cuda_graphs": e.runner.graphs is not None, "step_ms": t * 1e3,
               "host_ms": tt["host_s"] * 1e3,
               "weight_GB": wb / 1e9, "kv_GB": kvb / 1e9, "mla": e.cache.spec.mla}
        served = a.served_steps > 0 and not e.config.enforce_eager  # the eager engines' rows: synchronous only
        if served:
            sv = served_decode_step(e, a.batch, a.ctx, a.served_steps)
            row.update(served_step_ms=sv["step_s"] * 1e3, served_steps=sv["steps"])
        if "copy_bandwidth_GBs" in self.res:
            roof = (wb + kvb) / (self.res["copy_bandwidth_GBs"] * 1e9)
            row.update(roofline_ms=roof * 1e3, ratio=t / roof)
            if served:
                row["served_ratio"] = row["served_step_ms"] / 1e3 / roof
        if e.runner.graphs is not None and "anatomy" not in self.skip:
            row["anatomy"] = step_anatomy(e, a.batch, a.ctx)
        return row

    def decode(self, fmt, eager):
        cfg = self._decode_cfg(fmt, eager)
        try:
            row = _with_engine(cfg, lambda e: self._step_row(e, fmt))
        except Exception as ex:
            row = {"kv": fmt, "eager": eager, "error": f"{type(ex).__name__}: {ex}"[:300]}
        self.res.setdefault("decode", []).append(row)
        return ("decode", row)

    def profile_step(self, fmt):
        """Where an eager decode step's GPU time goes, by kernel (torch profiler)."""
        cfg = self._decode_cfg(fmt, True)
        row = {"kv": fmt, **_with_engine(cfg, lambda e: kernel_breakdown(e, self.args.batch, self.args.ctx))}
        self.res.setdefault("profile", []).append(row)
        return ("profile", row)

    def prefill(self, fmt):
        """A prefill step's wall time and its GPU kernels by kind (Triton prefill, as ``kvbench serve --backend triton``)."""
        a = self.args
        n, p = (int(x) for x in a.prefill.lower().split("x"))
        cfg = EngineConfig(model=a.model, kv_dtype=fmt, prefill_backend="triton", decode_backend=a.decode_backend,
                           device=a.device, max_running=max(n, 1), max_num_batched_tokens=n * p, max_model_len=p + 16,
                           kv_budget_gb=n * (p + 16) * 1.05 * _bpt(a.model, fmt) / 2**30, enforce_eager=True,
                           gemm_library=a.gemm_library)
        row = {"kv": fmt, **_with_engine(cfg, lambda e: prefill_breakdown(e, n, p))}
        self.res.setdefault("prefill", []).append(row)
        return ("prefill", row)

    def capacity(self, fmt):
        a = self.args
        cfg = EngineConfig(model=a.model, kv_dtype=fmt, device=a.device, prefill_backend="torch",
                           decode_backend=a.decode_backend, kv_budget_gb=a.capacity_budget_gb, max_running=256,
                           max_model_len=2048, enforce_eager=True)

        def capacity_row(e) -> dict:
            plan = e.cache.capacity(1024)
            try:
                r = peak_concurrency(e, n_requests=min(4 * plan.max_concurrency + 4, 256), prompt_len=1000, gen_len=24)
            except Exception as ex:
                r = {"error": f"{type(ex).__name__}: {ex}"[:300]}
            return {"kv": fmt, "budget_GiB": a.capacity_budget_gb, "bytes_per_token": e.cache.bytes_per_token,
                    "planned_at_1024": plan.max_concurrency, **r}

        row = _with_engine(cfg, capacity_row)
        self.res.setdefault("capacity", []).append(row)
        return ("capacity", row)

    def matrix(self, key, model, budget):
        for row in iter_format_matrix(model, self.args.device, PROMPTS, 32, budget, self.pairs):
            self.res.setdefault(key, []).append(row)
            yield (key, row)

    def concurrent(self):
        self.res["concurrent"] = concurrent_check(self.args.device)
        return ("concurrent", self.res["concurrent"])


def _backend_pairs() -> list:
    """The (prefill, decode) backend pairs of the format matrix; FlashInfer's where it is available."""
    pairs = [("triton", "triton"), ("torch", "triton"), ("triton", "torch")]
    from kvbench.runtime import backend_class

    try:
        if backend_class("flashinfer").available()[0]:
            pairs += [("flashinfer", "flashinfer"), ("triton", "flashinfer")]
    except Exception as e:
        print("flashinfer not used:", e, flush=True)
    return pairs


def _steps(sec: _Sections, formats, skip: set) -> list:
    """The run's measurements in order, less the ``--skip`` sections."""
    args = sec.args
    steps = []
    if "bandwidth" not in skip:
        steps.append(Step("copy bandwidth", sec.bandwidth))
    if "decode" not in skip:
        steps += [Step(f"decode step {fmt} B={args.batch} L={args.ctx} {'eager' if eager else 'CUDA graphs'}",
                       lambda fmt=fmt, eager=eager: sec.decode(fmt, eager))
                  for fmt in formats for eager in (True, False)]
    if "profile" not in skip and args.device.startswith("cuda"):
        steps += [Step(f"kernel breakdown {fmt} B={args.batch} L={args.ctx} eager", lambda fmt=fmt: sec.profile_step(fmt))
                  for fmt in formats]
    if "prefill" not in skip and args.device.startswith("cuda"):
        steps += [Step(f"prefill step {fmt} {args.prefill}", lambda fmt=fmt: sec.prefill(fmt)) for fmt in formats]
    if "capacity" not in skip:
        steps += [Step(f"capacity {fmt} {args.capacity_budget_gb} GiB", lambda fmt=fmt: sec.capacity(fmt)) for fmt in format_names()]
    if "matrix" not in skip:
        steps.append(Step(f"format x backend matrix {args.model}", lambda: sec.matrix("matrix", args.model, 8.0)))
    if "default" not in skip:
        steps.append(Step("format x backend matrix, default model", lambda: sec.matrix("matrix_default", None, 1.0)))
    if "concurrent" not in skip:
        steps.append(Step("16 concurrent requests, default model", sec.concurrent))
    return steps


def main(argv=None) -> None:
    args = _parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    formats = tuple(filter(None, args.formats.split(","))) or bench_formats()
    sec = _Sections(args, skip)
    sec.pairs = _backend_pairs()
    for _ in stream_rows(_steps(sec, formats, skip), fmt=lambda kr: f"{kr[0]:<14} {json.dumps(kr[1])}",
                         header=f"{'section':<14} row (JSON)"):
        sec.save()


def _with_engine(cfg: EngineConfig, fn, loaded=None):
    """``fn(engine)`` on a fresh engine, which is shut down and its memory returned afterwards (even on error),
    so the next configuration starts from an empty device."""
    from kvbench.runtime import Engine

    e = Engine(cfg, loaded=loaded)
    try:
        return fn(e)
    finally:
        e.shutdown()
        del e
        _free()


def _free() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _bpt(model: str, fmt: str) -> float:
    """KV bytes per token of a synthetic model (latent plane for MLA), for sizing the decode budget."""
    from kvbench.runtime import bytes_per_token
    from kvbench.runtime import parse_synthetic

    cfg = parse_synthetic(model) if model and model.startswith("synthetic:") else None
    if cfg is None:
        return 2 * 32 * 8 * 128 * 2.0
    return bytes_per_token(cfg.kv_spec(fmt, 16))


if __name__ == "__main__":
    main()
