"""GPU check of scoring with decode semantics in prefill passes (Engine.score mode="prefill" against
mode="decode") on the Triton backend (and FlashInfer where it is importable), bfloat16 compute.

For each backend and KV format: a small synthetic Llama scores one continuation in both modes and, as a
control, in prefill mode with the round trip switched off (continuation tokens see their own K/V in
compute precision).  Prints max / mean KL between the modes, the control's KL, greedy-flag and top-1
differences, and the time of each mode (after a warm-up run of the same text).  The prefill mode is right when its KL to the decode mode is far
below the control's.

    python docs/scripts/gpu_score_modes.py [--formats bf16,fp8_e4m3,nvfp4] [--backends triton,flashinfer]
"""

from __future__ import annotations

import argparse
import logging
import time


def main() -> int:
    import torch

    from kvbench.runtime.config import EngineConfig
    from kvbench.runtime.engine import Engine
    from kvbench.runtime.models import runner as runner_mod
    from kvbench.runtime.models.loader import load_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="bf16,fp16,fp8_e4m3,fp8_e5m2,nvfp4")
    ap.add_argument("--backends", default="triton,flashinfer")
    ap.add_argument("--model", default="synthetic:llama-3-8b,layers=4,hidden=512,heads=8,kv_heads=2,head_dim=64,"
                                       "intermediate_size=1024,vocab=4096")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--scored", type=int, default=600)
    ap.add_argument("--batched-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    a = ap.parse_args()
    logging.disable(logging.WARNING)
    loaded = load_model(a.model, device=torch.device("cuda"), dtype=torch.bfloat16, seed=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, loaded.config.vocab_size, (a.context + a.scored,), generator=g).tolist()
    ctx, cont = ids[: a.context], ids[a.context:]
    orig = runner_mod.ModelRunner.metadata
    off = [False]

    def metadata(self, phase, inp):
        t, meta = orig(self, phase, inp)
        if off[0]:
            meta.roundtrip_seqs_cpu, meta.roundtrip_rows = [], None
        return t, meta

    runner_mod.ModelRunner.metadata = metadata

    def kl(p, q):
        k = (p.exp() * (p - q)).sum(-1)
        return float(k.max()), float(k.mean())

    print("| backend | KV | KL max / mean (prefill vs decode) | control KL max / mean | greedy diff | top-1 diff | decode s | prefill s |")
    print("|---|---|---|---|---|---|---|---|")
    for be in a.backends.split(","):
        for fmt in a.formats.split(","):
            try:
                e = Engine(EngineConfig(kv_dtype=fmt, kv_scales="unit" if fmt in ("bf16", "fp16") else "calibrate",
                                        prefill_backend=be, decode_backend=be, kv_budget_gb=1.0, max_model_len=a.max_model_len,
                                        max_num_batched_tokens=a.batched_tokens, device="cuda", dtype="bfloat16"), loaded=loaded)
            except Exception as ex:  # unsupported pair or package missing
                print(f"| {be} | {fmt} | not run: {type(ex).__name__}: {str(ex).splitlines()[0][:120]} | | | | | |")
                continue
            try:
                # warm-up: kernel compilation for every launch shape of the run below
                e.score(ctx, cont, mode="decode")
                e.score(ctx, cont)
                t = time.perf_counter()
                ref = e.score(ctx, cont, top_k=1, full_distribution=True, mode="decode")
                t_dec = time.perf_counter() - t
                t = time.perf_counter()
                new = e.score(ctx, cont, top_k=1, full_distribution=True)
                t_pre = time.perf_counter() - t
                off[0] = True
                try:
                    plain = e.score(ctx, cont, top_k=1, full_distribution=True)
                finally:
                    off[0] = False
                k1, k2 = kl(ref.full_logprobs, new.full_logprobs), kl(ref.full_logprobs, plain.full_logprobs)
                gd = sum(x != y for x, y in zip(ref.greedy, new.greedy))
                td = sum(x[0] != y[0] for x, y in zip(ref.top_ids, new.top_ids))
                print(f"| {be} | {fmt} | {k1[0]:.2e} / {k1[1]:.2e} | {k2[0]:.2e} / {k2[1]:.2e} | {gd}/{len(cont)} | {td}/{len(cont)} "
                      f"| {t_dec:.2f} | {t_pre:.2f} |", flush=True)
            except Exception as ex:
                print(f"| {be} | {fmt} | failed: {type(ex).__name__}: {str(ex).splitlines()[0][:120]} | | | | | |", flush=True)
            finally:
                e.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
