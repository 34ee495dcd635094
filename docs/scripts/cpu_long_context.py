"""Long-context CPU benchmark of the embedded engine: prefill wall time and peak memory for long prompts,
and teacher-forced scoring time in both score modes (docs/performance.md, "CPU long-context prefill and
scoring").

Each case runs in its own subprocess (a fresh engine on the default model, float32 on the CPU) so the
memory figures do not mix.  Memory: the process RSS is sampled every 5 ms by a thread; "before" is the
RSS after the engine is built and warmed up on a short prompt, "peak" the largest sample while the case
runs, "added" their difference (the prefill's working memory; the KV pages are allocated up front and
are part of "before").  Also printed: ``ru_maxrss``, the lifetime peak including model loading.

Prompts are natural text: GSM8K test questions and answers (``--data``, one JSON object a line) joined and
cut to the exact token count.  Usage:

    python docs/scripts/cpu_long_context.py prefill --lengths 2048,4096,8192 --kv bf16,nvfp4
    python docs/scripts/cpu_long_context.py prefill --lengths 8192 --kv bf16 --batched-tokens 8192
    python docs/scripts/cpu_long_context.py score --lengths 944 --modes decode,prefill --kv bf16
    python docs/scripts/cpu_long_context.py score --lengths 8192 --modes prefill --kv bf16,nvfp4
    python docs/scripts/cpu_long_context.py agree --lengths 300 --kv bf16,fp8_e4m3,nvfp4

``agree`` scores one text four ways (decode mode alone; decode mode while two generation requests share
the engine's steps; prefill mode; prefill mode in 64-token chunks) and prints how far each pair differs
(greedy flags, |logprob difference|, KL of the full rows): the spread between two decode runs that only
differ in batch shape is the floor any comparison of the modes can reach.

Prints one JSON line per case (``--out FILE`` also appends them to FILE).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time

DEFAULT_DATA = "/work/shared/data/gsm8k_test.jsonl"


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Largest RSS seen by a 5 ms sampling thread between ``start`` and ``stop``."""

    def __init__(self):
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.005)

    def __enter__(self):
        self.peak = _rss()
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())


def _text_tokens(tok, path: str, n: int) -> list[int]:
    ids: list[int] = []
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            ids += tok.encode(f"Question: {row['question']}\nAnswer: {row['answer']}\n\n", add_special_tokens=False)
            if len(ids) >= n:
                return ids[:n]
    raise SystemExit(f"{path} holds fewer than {n} tokens")


def run_agree(case: dict) -> dict:
    """Score one text in four ways on one loaded model and compare them pairwise."""
    import torch

    from kvbench.core.client import SamplingParams
    from kvbench.runtime.config import EngineConfig
    from kvbench.runtime.engine import Engine
    from kvbench.runtime.models.loader import load_model

    loaded = load_model(None)
    kv, n = case["kv"], case["length"]
    scales = "unit" if kv in ("bf16", "fp16") else "calibrate"
    res = {}
    for name, kw in (("decode", {}), ("prefill", {}), ("prefill_c64", {"max_num_batched_tokens": 64})):
        e = Engine(EngineConfig(kv_dtype=kv, kv_scales=scales, kv_budget_gb=0.1, **kw), loaded=loaded)
        try:
            ids = _text_tokens(e.tokenizer, case["data"], n)
            ctx, cont = ids[: case["context"]], ids[case["context"]:]
            res[name] = e.score(ctx, cont, full_distribution=True, mode="decode" if name == "decode" else "prefill")
            if name == "decode":  # again, with two generation requests in the same steps
                other = e.tokenizer.encode("Write a long story about a dragon.")
                t = threading.Thread(target=lambda: e.generate(
                    [other, other[:5]], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)))
                e.start()
                t.start()
                res["decode_busy"] = e.score(ctx, cont, full_distribution=True, mode="decode")
                t.join()
        finally:
            e.shutdown()
    out = dict(case, scored_tokens=len(res["decode"].logprobs), pairs={})
    for a, b in (("decode", "decode_busy"), ("decode", "prefill"), ("prefill", "prefill_c64")):
        A, B = res[a], res[b]
        d = (torch.tensor(A.logprobs) - torch.tensor(B.logprobs)).abs()
        kl = (A.full_logprobs.exp() * (A.full_logprobs - B.full_logprobs)).sum(-1)
        out["pairs"][f"{a}~{b}"] = dict(
            greedy_diff=sum(x != y for x, y in zip(A.greedy, B.greedy)), dlogprob_mean=float(f"{d.mean():.3g}"),
            dlogprob_max=float(f"{d.max():.3g}"), kl_mean=float(f"{kl.mean():.3g}"), kl_max=float(f"{kl.max():.3g}"))
    return out


def run_one(case: dict) -> dict:
    """One case in this process."""
    import torch

    from kvbench.core.client import SamplingParams
    from kvbench.runtime.config import EngineConfig
    from kvbench.runtime.engine import Engine

    torch.set_num_threads(case["threads"]) if case["threads"] else None
    cfg = dict(kv_dtype=case["kv"], device="cpu", dtype="float32")
    if case["batched_tokens"]:
        cfg["max_num_batched_tokens"] = case["batched_tokens"]
    if case["kv"] not in ("bf16", "fp16"):
        cfg["kv_scales"] = "calibrate"
    e = Engine(EngineConfig(**cfg))
    try:
        tok = e.tokenizer
        n = case["length"]
        warm = _text_tokens(tok, case["data"], 64)
        e.generate([warm], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        before = _rss()
        res = dict(case, max_model_len=e.max_model_len, max_num_batched_tokens=e.config.max_num_batched_tokens,
                   torch=torch.__version__, threads_used=torch.get_num_threads())
        if case["what"] == "prefill":
            ids = _text_tokens(tok, case["data"], n)
            with PeakRSS() as mem:
                t = time.perf_counter()
                out = e.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))[0]
                res["seconds"] = round(time.perf_counter() - t, 2)
            res["prompt_tokens"] = len(ids)
            res["tokens_per_s"] = round(len(ids) / res["seconds"], 1)
            res["finish_reason"] = out.finish_reason
        else:
            ids = _text_tokens(tok, case["data"], n)
            ctx, cont = ids[: case["context"]], ids[case["context"]:]
            with PeakRSS() as mem:
                t = time.perf_counter()
                sc = e.score(ctx, cont, mode=case["mode"])
                res["seconds"] = round(time.perf_counter() - t, 2)
            res.update(context_tokens=len(ctx), scored_tokens=len(cont),
                       mean_logprob=round(sum(sc.logprobs) / len(sc.logprobs), 4),
                       greedy_rate=round(sum(sc.greedy) / len(sc.greedy), 4))
        res["rss_before_mb"] = round(before / 2**20)
        res["rss_peak_mb"] = round(mem.peak / 2**20)
        res["rss_added_mb"] = round((mem.peak - before) / 2**20)
        res["ru_maxrss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        return res
    finally:
        e.shutdown()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("prefill", "score", "agree"))
    ap.add_argument("--lengths", default="2048,4096,8192", help="total tokens per case")
    ap.add_argument("--kv", default="bf16,nvfp4")
    ap.add_argument("--modes", default="prefill", help="score modes (score only): prefill, decode")
    ap.add_argument("--context", type=int, default=16, help="score: context tokens (the rest is scored)")
    ap.add_argument("--batched-tokens", type=int, default=0, help="max_num_batched_tokens (0 = engine default)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        case = json.loads(a.one)
        print("RESULT " + json.dumps(run_agree(case) if case["what"] == "agree" else run_one(case)), flush=True)
        return 0
    if not os.path.exists(a.data):
        raise SystemExit(f"no such data file: {a.data}")
    modes = a.modes.split(",") if a.what == "score" else [None]
    for n in (int(x) for x in a.lengths.split(",")):
        for kv in a.kv.split(","):
            for mode in modes:
                case = dict(what=a.what, length=n, kv=kv, mode=mode, context=a.context, batched_tokens=a.batched_tokens,
                            threads=a.threads, data=a.data)
                p = subprocess.run([sys.executable, __file__, a.what, "--one", json.dumps(case)], capture_output=True, text=True)
                lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
                if p.returncode or not lines:
                    print(json.dumps(dict(case, error=p.stderr.strip().splitlines()[-1:] or [f"exit {p.returncode}"])), flush=True)
                    continue
                line = lines[-1][len("RESULT "):]
                print(line, flush=True)
                if a.out:
                    with open(a.out, "a") as f:
                        f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
