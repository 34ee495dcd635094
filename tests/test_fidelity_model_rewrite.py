"""`kvbench eval --suite fidelity` on a real (tiny) Hugging Face model directory that is rewritten in place between
runs, as a user re-quantizing a checkpoint at the same path would: the cached reference must not be reused.

bf16 KV against its own bf16 reference has KL 0 whatever the weights; a reference left over from the old
weights gives a large KL (the user's report: KL 1.62 and perplexity 5.97 -> 20.49).  The engine runs on the CPU,
the model has two layers of width 32 and a byte-level tokenizer, and two GSM8K texts are scored.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not (DATA / "gsm8k_test.jsonl").exists() and not os.environ.get("CI"), reason="shared data not present"),
]


def _tokenizer(d: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}  # the same ids every time
    vocab["<s>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>").save_pretrained(d)
    return len(vocab)


def _write_model(d: Path, seed: int) -> None:
    """A tiny llama checkpoint (config, tokenizer, safetensors) with weights drawn from ``seed``."""
    import torch
    import transformers

    vocab = _tokenizer(d)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=vocab, max_position_embeddings=2048, bos_token_id=vocab - 1)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)  # peaked distributions: other weights give visibly other log-probs
    model.save_pretrained(d, safe_serialization=True)


def _eval(model: Path, cache: Path, out: Path) -> dict:
    from kvbench.harness.cli import app

    r = CliRunner().invoke(app, ["eval", "--suite", "fidelity", "--model", str(model), "--device", "cpu", "--limit", "2",
                                 "--kv-budget-gb", "0.01", "--fidelity-cache", str(cache), "--fidelity-top-k", "8",
                                 "--greedy-tokens", "4", "--data-dir", str(DATA), "--out", str(out), "--no-progress"])
    assert r.exit_code == 0, r.output
    return json.loads((out / "summary.json").read_text())["suites"]["fidelity"]


def test_rewritten_model_rebuilds_the_fidelity_reference(tmp_path, caplog):
    model, cache = tmp_path / "model", tmp_path / "cache"
    model.mkdir()
    _write_model(model, seed=1)
    first = _eval(model, cache, tmp_path / "a")
    assert first["kl_mean"] < 1e-6  # bf16 against its own reference
    assert len(list(cache.glob("*.json"))) == 1
    _write_model(model, seed=2)  # re-quantized / re-exported at the same path
    with caplog.at_level(logging.WARNING):
        second = _eval(model, cache, tmp_path / "b")
    assert second["kl_mean"] < 1e-6, f"a reference of the old weights was reused: KL {second['kl_mean']:.3g}"
    assert second["ppl_ref"] == pytest.approx(second["ppl_cand"], rel=1e-6)
    assert abs(second["ppl_ref"] - first["ppl_ref"]) > 1e-3  # the weights did change
    assert any("model file changed since the cached reference" in r.getMessage() for r in caplog.records)
    assert len(list(cache.glob("*.json"))) == 1  # the stale entry was replaced
