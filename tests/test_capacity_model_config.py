"""`kvbench capacity` plans for a model's own config.json (or directory), per GPU under tensor parallelism,
and takes preset names in any case."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvbench.harness.cli import app
from kvbench.harness.commands.capacity import capacity_rows
from kvbench.runtime.model_shapes import get_shape, shape_from_hf_config, shard_shape

QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 36, "max_position_embeddings": 40960}
DSV3 = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168, "num_attention_heads": 128,
        "num_key_value_heads": 128, "num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128, "v_head_dim": 128, "max_position_embeddings": 163840}


def invoke(*args):
    r = CliRunner().invoke(app, ["capacity", *map(str, args)])
    return r.exit_code, r.stdout + (r.stderr or "")


def rows_of(*args):
    code, text = invoke(*args, "--json")
    assert code == 0, text
    return json.loads(text)


def test_config_json_matches_the_builtin_shape(tmp_path):
    d = tmp_path / "Qwen3-8B"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(QWEN3_8B))
    builtin = rows_of("--model-shape", "qwen3-8b", "--kv-budget-gb", "8")
    for ref in (d, d / "config.json"):
        rows = rows_of("--model-config", ref, "--kv-budget-gb", "8")
        assert [r["bytes_per_token"] for r in rows] == [r["bytes_per_token"] for r in builtin]
        assert [r["max_concurrency"] for r in rows] == [r["max_concurrency"] for r in builtin]
        assert rows[0]["model"] == "Qwen3-8B" and rows[0]["bytes_per_token"] == 36 * 8 * 128 * 2 * 2


def test_mla_config_and_multimodal_text_config():
    s = shape_from_hf_config(DSV3, "dsv3")
    assert s.mla_latent_dim == 576 and s.kv_spec("bf16").mla and s.num_layers == 61
    nested = shape_from_hf_config({"architectures": ["X"], "text_config": QWEN3_8B}, "vlm")
    assert (nested.num_layers, nested.num_kv_heads, nested.head_dim) == (36, 8, 128)
    gqa_default = shape_from_hf_config({"hidden_size": 512, "num_attention_heads": 8, "num_hidden_layers": 2}, "x")
    assert (gqa_default.num_kv_heads, gqa_default.head_dim) == (8, 64)
    with pytest.raises(ValueError, match="no num_hidden_layers"):
        shape_from_hf_config({"hidden_size": 512, "num_attention_heads": 8}, "x")


def test_preset_names_are_case_insensitive():
    assert get_shape("Llama-3-8B") is get_shape("llama-3-8b")
    assert rows_of("--model-shape", "LLAMA-3-8B") == rows_of("--model-shape", "llama-3-8b")


@pytest.mark.parametrize("tp,per_gpu,note", [(1, 8, "tp 1"), (2, 4, "split"), (8, 1, "split"), (16, 1, "replicated")])
def test_tp_splits_kv_heads(tp, per_gpu, note):
    rows = capacity_rows("llama-3-8b", 10.0, 4096, tp=tp)
    whole = capacity_rows("llama-3-8b", 10.0, 4096)
    assert all(r["tp"] == tp and r["kv_heads_per_gpu"] == per_gpu and note in r["split"] for r in rows)
    assert rows[0]["bytes_per_token"] == whole[0]["bytes_per_token"] * per_gpu / 8
    assert rows_of("--tensor-parallel-size", tp, "--kv-budget-gb", 10) == rows_of("--tp", tp, "--kv-budget-gb", 10) == rows


def test_tp_that_does_not_fit_the_kv_heads_is_refused():
    code, text = invoke("--tp", 3)
    assert code == 2 and "--tp 3 does not divide the 8 kv heads of llama-3-8b" in text, text
    code, text = invoke("--tp", 0)
    assert code == 2 and "--tp must be >= 1" in text, text


def test_mla_latent_is_whole_on_each_gpu():
    s = get_shape("deepseek-v3")
    shard, note = shard_shape(s, 8)
    assert shard == s and "whole on each GPU" in note
    assert capacity_rows("deepseek-v3", 10.0, 4096, tp=8)[0]["bytes_per_token"] == \
        capacity_rows("deepseek-v3", 10.0, 4096)[0]["bytes_per_token"]


def test_bad_model_config_paths(tmp_path):
    code, text = invoke("--model-config", tmp_path / "nope.json")
    assert code == 2 and "no such file" in text, text
    code, text = invoke("--model-config", tmp_path)
    assert code == 2 and "has no config.json" in text, text
    (tmp_path / "config.json").write_text("{not json")
    code, text = invoke("--model-config", tmp_path / "config.json")
    assert code == 2 and "not a JSON config" in text, text
    code, text = invoke("--model-shape", "llama-9")
    assert code == 2 and "unknown model shape 'llama-9'" in text and "--model-config" in text, text


GEMMA3_270M = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 640, "num_hidden_layers": 18,
               "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 2048,
               "vocab_size": 262144, "sliding_window": 512, "sliding_window_pattern": 6, "max_position_embeddings": 32768}


def test_sliding_layers_counted_at_their_window(tmp_path):
    """Gemma 3 270M: 15 of 18 layers slide (window 512); the windowed column counts them at 33 pages of 16."""
    d = tmp_path / "gemma-3-270m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(GEMMA3_270M))
    rows = {r["name"]: r for r in rows_of("--model-config", d, "--kv-budget-gb", "1", "--context", "8192",
                                          "--kv-dtype-skip-layers", "global")}
    bf16 = rows["bf16"]
    layer_token = 2 * 1 * 256 * 2  # K and V, one kv head of 256, two bytes
    assert bf16["bytes_per_token"] == 18 * layer_token and bf16["sliding_layers"] == 15
    per_seq = 3 * 8192 * layer_token + 15 * (512 // 16 + 1) * 16 * layer_token
    assert bf16["windowed_bytes_per_seq"] == per_seq and bf16["max_concurrency_windowed"] == 2**30 // per_seq
    assert bf16["max_concurrency"] == 2**30 // (18 * layer_token * 8192)
    # "global" names the three full-attention layers (5, 11, 17): kept in bf16 beside fp8 sliding layers
    mixed = rows["fp8_e4m3 skip full_attention"]
    assert mixed["layer_formats"] == {"fp8_e4m3": 15, "bf16": 3}
    assert mixed["windowed_bytes_per_seq"] == 3 * 8192 * layer_token + 15 * 33 * 16 * layer_token // 2
    code, text = invoke("--model-config", d, "--kv-budget-gb", "1", "--context", "8192")
    assert code == 0 and "15 of 18 layers slide" in text
