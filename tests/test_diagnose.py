"""`kvbench diagnose`: a synthetic model with one layer given planted outliers is diagnosed, and the diagnosis
finds that layer first (KL contribution, K error, saturation, attention error); the suggestion's KL is checked
by an independent engine run; the command writes the diagnosis, its report and a confirm sweep that loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvbench.core.formats import get_spec
from kvbench.core.layer_formats import parse_layer_set
from kvbench.harness.diagnose import DiagnoseSettings, run_diagnosis
from kvbench.runtime.config import EngineConfig
from kvbench.runtime.engine import Engine
from kvbench.runtime.models.loader import load_model

MODEL = "synthetic:llama-3-8b,layers=4,hidden=128,heads=4,kv_heads=2,head_dim=32,vocab=300,intermediate_size=256"
PLANTED_LAYER, PLANTED_HEAD = 2, 1


def _planted(seed: int = 3):
    """The model with one K channel of (layer 2, kv head 1) scaled by 5000: its K values pass fp8_e4m3's 448 under
    unit scales and saturate; every other layer stays well inside the range."""
    loaded = load_model(MODEL, seed=seed)
    hd = loaded.config.head_dim
    with torch.no_grad():
        loaded.model.model.layers[PLANTED_LAYER].self_attn.k_proj.weight[PLANTED_HEAD * hd + 5].mul_(5000.0)
    loaded.model.bind()
    return loaded


def _texts(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(1, 290, (8,), generator=g).tolist(), torch.randint(1, 290, (48,), generator=g).tolist()) for _ in range(n)]


@pytest.fixture(scope="module")
def planted():
    loaded = _planted()
    cfg = EngineConfig(model=MODEL, kv_dtype="fp8_e4m3", kv_scales="unit")
    diag = run_diagnosis(cfg, _texts(), DiagnoseSettings(kl_limit=1e-3, budget_bytes=2**20, context_len=256), loaded=loaded)
    return loaded, cfg, diag


def test_planted_layer_is_found_first(planted):
    _, _, diag = planted
    layers = diag["layers"]
    contrib = [d["kl_contribution"] for d in layers]
    assert max(range(4), key=lambda i: contrib[i]) == PLANTED_LAYER
    assert contrib[PLANTED_LAYER] > 5 * max(c for i, c in enumerate(contrib) if i != PLANTED_LAYER)
    k_err = [[d["k"]["rel_err"][h] for h in range(2)] for d in layers]
    worst = max(((i, h) for i in range(4) for h in range(2)), key=lambda ih: k_err[ih[0]][ih[1]])
    assert worst == (PLANTED_LAYER, PLANTED_HEAD)
    sat = [[d["k"]["saturated"][h] for h in range(2)] for d in layers]
    assert sat[PLANTED_LAYER][PLANTED_HEAD] > 0
    assert all(sat[i][h] == 0 for i in range(4) for h in range(2) if (i, h) != (PLANTED_LAYER, PLANTED_HEAD))
    # the scale in use (unit) against the observed amax: the planted head's amax is far past the format's max
    k = layers[PLANTED_LAYER]["k"]
    assert k["scale"][PLANTED_HEAD] == 1.0 and k["max_repr"][PLANTED_HEAD] == 448.0 and k["amax"][PLANTED_HEAD] > 448.0
    attn = [max(d["attn_rel_err"]) for d in layers]
    assert max(range(4), key=lambda i: attn[i]) == PLANTED_LAYER
    # leave-one-out: KL(full) - KL(layer in bf16), the KL of the run with that layer in bf16 is recorded too
    for d in layers:
        assert d["kl_contribution"] == pytest.approx(diag["kl"]["full"] - d["kl_loo"])
    assert diag["kl"]["tokens"] == 3 * 48 and 0 < diag["kl"]["top1_agree"] <= 1


def test_suggestion_is_measured_and_independently_confirmed(planted):
    loaded, cfg, diag = planted
    s = diag["suggestion"]
    assert s["met"] and s["kl"] <= s["limit"] == 1e-3
    skipped = parse_layer_set(s["skip_layers"])[0]
    assert s["ranking"][0] == PLANTED_LAYER and PLANTED_LAYER in skipped
    assert set(skipped) == set(s["ranking"][: len(skipped)])  # a prefix of the ranking
    steps = {st["n_skipped"]: st for st in s["steps"]}
    k = len(skipped)
    assert steps[k]["kl"] == pytest.approx(s["kl"]) and steps[k]["kl"] <= s["limit"]
    assert k == 0 or steps[k - 1]["kl"] > s["limit"]  # one layer fewer was measured and misses the limit
    # an engine built from scratch with the suggested skip set gives the same KL against a bf16 engine
    ref_e = Engine(EngineConfig(kv_dtype="bf16", kv_budget_gb=0.01, max_model_len=128), loaded=loaded)
    cand_e = Engine(EngineConfig(kv_dtype="fp8_e4m3", kv_scales="unit", kv_dtype_skip_layers=s["skip_layers"],
                                 kv_budget_gb=0.01, max_model_len=128), loaded=loaded)
    try:
        tot, n = 0.0, 0
        for ctx, cont in _texts():
            p = ref_e.score(ctx, cont, full_distribution=True).full_logprobs.double()
            q = cand_e.score(ctx, cont, full_distribution=True).full_logprobs.double()
            tot += float((p.exp() * (p - q)).sum(-1).clamp_min(0).sum())
            n += len(cont)
    finally:
        ref_e.shutdown()
        cand_e.shutdown()
    assert tot / n == pytest.approx(s["kl"], rel=1e-6, abs=1e-12)
    # capacity rows: exact bytes per token of each map (2 planes x 2 kv heads x head_dim 32 per layer)
    rows = {r["name"]: r for r in s["capacity"]["rows"]}
    n_skip = len(skipped)
    assert rows["bf16"]["bytes_per_token"] == 4 * 2 * 2 * 64
    assert rows["fp8_e4m3"]["bytes_per_token"] == 4 * 2 * 2 * 32
    assert rows[f"fp8_e4m3 skip {s['skip_layers']}"]["bytes_per_token"] == n_skip * 256 + (4 - n_skip) * 128
    assert rows["fp8_e4m3"]["tokens"] == (2**20 // (512 * 16)) * 16


def test_no_leave_one_out_means_no_contributions_and_no_suggestion():
    loaded = _planted()
    diag = run_diagnosis(EngineConfig(model=MODEL, kv_dtype="nvfp4", kv_scales="calibrate", kv_dtype_skip_layers="0"), _texts(1),
                         DiagnoseSettings(leave_one_out=False), loaded=loaded)
    assert diag["layer_dtypes"] == ["bf16", "nvfp4", "nvfp4", "nvfp4"]
    assert all(d["kl_contribution"] is None for d in diag["layers"]) and diag["suggestion"] is None
    assert diag["runs"] == 2 and diag["layers"][0]["format"] == "bf16"
    assert diag["layers"][1]["k"]["max_repr"] is not None  # nvfp4: the block scale's max times 6 times the scale
    # the candidate's scales are the configuration's own (calibration prompts cut to its context, not the texts')
    e = Engine(EngineConfig(model=MODEL, kv_dtype="nvfp4", kv_scales="calibrate", kv_dtype_skip_layers="0", kv_budget_gb=0.01),
               loaded=loaded)
    try:
        assert diag["scales"] == e.scales.summary()
    finally:
        e.shutdown()
    with pytest.raises(ValueError, match="leave-one-out"):
        run_diagnosis(EngineConfig(model=MODEL, kv_dtype="nvfp4"), _texts(1), DiagnoseSettings(kl_limit=0.1, leave_one_out=False),
                      loaded=loaded)


def _data_dir(tmp_path):
    rows = [{"question": f"Tom has {i} apples and buys {i + 3} more. How many now?",
             "answer": f"Tom has {i} + {i + 3} = {2 * i + 3} apples.\n#### {2 * i + 3}"} for i in range(6)]
    d = tmp_path / "data"
    d.mkdir()
    (d / "gsm8k_test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def test_command_writes_diagnosis_report_and_a_confirm_sweep_that_loads(tmp_path):
    from kvbench.harness.cli import app
    from kvbench.harness.sweep.config import load_config
    from kvbench.harness.matrix import expand

    out = tmp_path / "diag"
    argv = ["diagnose", "--model", MODEL, "--kv-dtype", "fp8_e5m2", "--kv-scales", "calibrate", "--limit", "2",
            "--data-dir", str(_data_dir(tmp_path)), "--kl-limit", "1e-6", "--out", str(out), "--kv-budget-gb", "0.01"]
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 0, r.output
    diag = json.loads((out / "diagnostics.json").read_text())
    assert diag["schema"] == "kvbench:diagnostics:v1" and diag["texts"]["n"] == 2 and diag["texts"]["label"] == "gsm8k-solutions"
    assert len(diag["layers"]) == 4 and all(get_spec(f).quantized for f in diag["layer_dtypes"])
    html = (out / "report.html").read_text()
    assert "data:image/png;base64," in html and "Where the error comes from" in html
    assert "KL contribution by layer" in r.output and "suggestion: keep layers" in r.output
    sweep = load_config(out / "confirm.yaml")
    kv = [(k.dtype, k.options.get("kv_dtype_skip_layers")) for k in sweep.kv]
    assert kv[0] == ("bf16", None) and kv[1] == ("fp8_e5m2", None)
    assert kv[-1] == ("fp8_e5m2", diag["suggestion"]["skip_layers"]) or diag["suggestion"]["skip_layers"] is None
    assert {s.name for s in sweep.suites} == {"fidelity", "ruler"}
    keys = {c.key for c in expand(sweep)}
    assert len(keys) == len(expand(sweep))
    # a diagnosis already there is kept unless --overwrite; a bf16 candidate is refused (nothing to diagnose)
    again = CliRunner().invoke(app, argv)
    assert again.exit_code == 2 and "already holds a diagnosis" in again.output
    plain = CliRunner().invoke(app, ["diagnose", "--model", MODEL, "--kv-dtype", "bf16", "--out", str(tmp_path / "x")])
    assert plain.exit_code == 2 and "not quantized" in plain.output


def test_sweep_cells_carry_diagnostics_and_the_report_draws_them(tmp_path):
    from kvbench.harness.matrix import expand
    from kvbench.harness.runner import run_sweep
    from kvbench.core.store import RunStore
    from kvbench.harness.sweep.config import SweepConfigError, parse_config
    from kvbench.harness.cli import app

    raw = {
        "name": "diag", "model": MODEL,
        "engine": {"device": "cpu", "dtype": "float32", "kv_budget_gb": 0.01, "max_model_len": 256, "max_running": 2},
        "axes": {"kv": ["bf16", {"dtype": "fp8_e4m3", "scales": "calibrate"},
                        {"dtype": "fp8_e4m3", "scales": "calibrate", "kv_dtype_skip_layers": [3, 0]}], "concurrency": [1]},
        "suites": [{"name": "fidelity", "limit": 1, "params": {"top_k": 8, "greedy_tokens": 4}}],
        "load": {"enabled": False},
        "diagnostics": {"limit": 2, "kl_limit": 1e-5},
        "data_dir": str(_data_dir(tmp_path)),
    }
    cfg = parse_config(raw)
    out = run_sweep(cfg, tmp_path / "run", progress=False)
    st = RunStore(tmp_path / "run")
    assert out.ok, {k: st.read_json(k, "summary")["error"] for k in out.failed}
    bf16, fp8, skip, aa = expand(cfg)
    assert st.read_json(bf16.key, "diagnostics") is None and st.read_json(aa.key, "diagnostics") is None
    d = st.read_json(fp8.key, "diagnostics")
    assert d["kv_dtype"] == "fp8_e4m3" and d["texts"]["n"] == 2 and len(d["layers"]) == 4
    assert d["suggestion"]["capacity"]["budget_bytes"] == pytest.approx(0.01 * 2**30, rel=1e-6)
    s = st.read_json(fp8.key, "summary")["diagnostics"]
    assert s["kl"] == d["kl"]["full"] and s["suggested_skip_layers"] == d["suggestion"]["skip_layers"]
    ds = st.read_json(skip.key, "diagnostics")  # the cell's own map is diagnosed: layers 0 and 3 in bf16
    assert ds["layer_dtypes"] == ["bf16", "fp8_e4m3", "fp8_e4m3", "bf16"] and ds["kv_dtype_skip_layers"] == "0,3"
    assert ds["layers"][0]["kl_contribution"] is None and ds["layers"][1]["kl_contribution"] is not None
    r = CliRunner().invoke(app, ["report", str(tmp_path / "run"), "--out", str(tmp_path / "report")])
    assert r.exit_code == 0, r.output
    md = (tmp_path / "report" / "report.md").read_text()
    assert md.count("Where the error comes from") == 2
    for bad, msg in (({"kl_limit": 0.1, "leave_one_out": False}, "keep leave_one_out on"), ({"limt": 2}, "limt")):
        with pytest.raises(SweepConfigError, match=msg):
            parse_config({**raw, "diagnostics": bad})


def test_eval_diagnose_writes_the_diagnosis_beside_the_items(tmp_path):
    from kvbench.harness.cli import app

    out = tmp_path / "eval"
    argv = ["eval", "--model", MODEL, "--suite", "fidelity", "--limit", "1", "--kv-dtype", "fp8_e5m2", "--kv-scales", "calibrate",
            "--data-dir", str(_data_dir(tmp_path)), "--out", str(out), "--kv-budget-gb", "0.01", "--diagnose", "--no-progress"]
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 0, r.output
    diag = json.loads((out / "diagnostics" / "diagnostics.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["diagnostics"]["kl"] == diag["kl"]["full"] > 0
    assert (out / "diagnostics" / "report.html").exists() and (out / "items.jsonl").exists()
    bad = CliRunner().invoke(app, ["eval", "--suite", "fidelity", "--diagnose", "--endpoint", "http://127.0.0.1:9", "--out", str(tmp_path / "y")])
    assert bad.exit_code == 2 and "embedded engine" in bad.output


def test_command_on_long_texts_from_a_haystack_file(tmp_path):
    from kvbench.harness.cli import app

    hay = tmp_path / "hay.txt"
    hay.write_text(" ".join(f"word{i % 97} is here." for i in range(2000)))
    out = tmp_path / "long"
    argv = ["diagnose", "--model", MODEL, "--kv-dtype", "nvfp4", "--kv-scales", "calibrate", "--limit", "1", "--text-tokens", "300",
            "--haystack-file", str(hay), "--no-leave-one-out", "--out", str(out), "--kv-budget-gb", "0.01"]
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 0, r.output
    diag = json.loads((out / "diagnostics.json").read_text())
    assert diag["texts"]["label"].startswith("texts=haystack-") and diag["texts"]["label"].endswith("-300")
    assert 297 <= diag["kl"]["tokens"] <= 300  # within 1% of the asked length, cut at a word boundary
    assert diag["suggestion"] is None and not (out / "confirm.yaml").exists()


def test_a_map_with_per_layer_formats_is_diagnosed_layer_by_layer():
    """nvfp4 with layer 0 in bf16 and layer 2 in fp8_e4m3: leave-one-out also switches layer 2 (a format of its
    own) to bf16, and the suggestion is spelled as options an engine and a sweep accept."""
    from kvbench.harness.diagnose_confirm import confirm_config
    from kvbench.harness.sweep.config import parse_config

    loaded = load_model(MODEL, seed=4)
    cfg = EngineConfig(model=MODEL, kv_dtype="nvfp4", kv_scales="calibrate", kv_dtype_skip_layers="0", kv_layer_dtypes="2:fp8_e4m3")
    diag = run_diagnosis(cfg, _texts(2), DiagnoseSettings(kl_limit=0.0, budget_bytes=2**20, context_len=128), loaded=loaded)
    assert diag["layer_dtypes"] == ["bf16", "nvfp4", "fp8_e4m3", "nvfp4"]
    assert [d["kl_contribution"] is None for d in diag["layers"]] == [True, False, False, False]
    s = diag["suggestion"]
    assert s["met"] and s["kl"] == 0.0 and s["skip_layers"] == "0-3" and s["kv_layer_dtypes"] is None  # all in bf16
    names = [r["name"] for r in s["capacity"]["rows"]]
    assert names == ["bf16", "nvfp4 (bf16 on 0; fp8_e4m3 on 2)", "nvfp4 skip 0-3"]
    mid = [st for st in s["steps"] if 0 < st["n_skipped"] < 3]
    assert mid and all(st.get("kv_layer_dtypes") in (None, "2:fp8_e4m3") for st in mid)
    for st in s["steps"]:  # every step is a map the engine takes
        EngineConfig(kv_dtype="nvfp4", kv_dtype_skip_layers=st["skip_layers"], kv_layer_dtypes=st.get("kv_layer_dtypes"))
    sweep = parse_config(confirm_config(cfg, diag, 2))
    kv = [(k.dtype, k.options.get("kv_dtype_skip_layers"), k.options.get("kv_layer_dtypes")) for k in sweep.kv]
    assert kv == [("bf16", None, None), ("nvfp4", "0", "2:fp8_e4m3"), ("nvfp4", "0-3", None)]
