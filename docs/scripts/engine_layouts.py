"""The engine's greedy tokens on head-major (HND) against token-major (NHD) KV pages (docs/kernels.md).

For each KV format and (prefill, decode) backend pair, the runtime ``Engine`` generates greedy tokens for the
first prompts of ``tools.engine_perf.PROMPTS`` twice on one loaded model — ``kv_layout="HND"`` and
``kv_layout="NHD"``, everything else equal (quantized formats with calibrated scales, as the perf matrix of
``tools/engine_perf.py``) — and prints how many prompts got identical tokens and where each first differs
(the token count when they agree).  A pair the engine refuses is shown as failed.

    python docs/scripts/engine_layouts.py [--model synthetic:llama-3-8b] [--formats bf16,fp8_e4m3]
        [--pairs triton+triton,triton+flashinfer] [--prompts 3] [--tokens 24]

A reconstruction, from docs/kernels.md's description, of the throw-away driver behind one of its statements;
a run at a later commit checks the engine as it is now.
"""

from __future__ import annotations

import argparse
import sys


def first_divergence(a: list, b: list) -> int:
    """Index of the first token where ``a`` and ``b`` differ (the shorter length when one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(hnd: list, nhd: list) -> tuple[int, list]:
    """(prompts with identical tokens, first divergence per prompt) of two runs' token lists."""
    return sum(x == y for x, y in zip(hnd, nhd)), [first_divergence(x, y) for x, y in zip(hnd, nhd)]


def parse_pairs(text: str) -> list[tuple[str, str]]:
    out = []
    for p in text.split(","):
        pre, sep, dec = p.strip().partition("+")
        if not sep or not pre or not dec:
            raise ValueError(f"a backend pair is PREFILL+DECODE, got {p!r}")
        out.append((pre, dec))
    return out


def generate(loaded, prompts, fmt: str, pre: str, dec: str, layout: str, tokens: int) -> list:
    import torch

    from kvbench.core.client import SamplingParams
    from kvbench.runtime.config import EngineConfig
    from kvbench.runtime.engine import Engine
    from kvbench.tools.common import is_plain

    cfg = EngineConfig(kv_dtype=fmt, kv_scales="unit" if is_plain(fmt) else "calibrate", prefill_backend=pre,
                       decode_backend=dec, device="cuda", kv_layout=layout, kv_budget_gb=1.0,
                       max_running=len(prompts), calibration_prompts=8)
    e = Engine(cfg, loaded=loaded)
    try:
        return [o.token_ids for o in e.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))]
    finally:
        e.shutdown()
        del e
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="synthetic:llama-3-8b")
    ap.add_argument("--formats", default="bf16,fp8_e4m3", help="comma-separated KV formats")
    ap.add_argument("--pairs", default="triton+triton,triton+flashinfer", help="PREFILL+DECODE backends, comma-separated")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=24, help="greedy tokens per prompt")
    a = ap.parse_args(argv)
    try:
        pairs = parse_pairs(a.pairs)
    except ValueError as e:
        ap.error(str(e))
    import logging

    import torch

    if not torch.cuda.is_available():
        sys.exit("this probe runs the engine on a GPU: no CUDA device")
    from kvbench.runtime.models.loader import load_model
    from kvbench.tools.engine_perf import PROMPTS

    logging.disable(logging.WARNING)  # unit-scale and calibration notices
    loaded = load_model(a.model, device="cuda", dtype=torch.bfloat16)
    prompts = [loaded.tokenizer.encode(t) for t in PROMPTS[: a.prompts]]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {a.model}: {len(prompts)} prompts × "
          f"{a.tokens} greedy tokens\n")
    print("| KV | prefill + decode | identical on HND and NHD | first divergence (tokens) |")
    print("|---|---|---|---|")
    for fmt in a.formats.split(","):
        for pre, dec in pairs:
            try:
                runs = {lay: generate(loaded, prompts, fmt, pre, dec, lay, a.tokens) for lay in ("HND", "NHD")}
            except Exception as e:  # an unsupported pair is reported, not hidden
                print(f"| {fmt} | {pre}+{dec} | failed: {type(e).__name__}: {' '.join(str(e).split())[:80]} | |",
                      flush=True)
                continue
            same, first = compare(runs["HND"], runs["NHD"])
            print(f"| {fmt} | {pre}+{dec} | {same}/{len(prompts)} | {', '.join(map(str, first))} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
