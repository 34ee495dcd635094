"""Selectors over a cell's KV-entry options: ``kv_dtype_skip_layers=0,1,31`` (commas inside the value),
``none`` for cells without the option, canonical comparison, and the report's reproduce commands that tell a
skip cell from the uniform cell of the same format."""

from __future__ import annotations

import pytest

from kvbench.core.store import matches, parse_selector
from kvbench.reports.load import CellData
from kvbench.reports.verdict import cell_selector

UNIFORM = {"model": "m", "target": "t", "prefill_backend": "torch", "decode_backend": "torch", "kv_dtype": "nvfp4",
           "kv_scales": "calibrate", "concurrency": 4}
SKIP = {**UNIFORM, "options": {"kv_dtype_skip_layers": "0,1,28-31"}}
MIXED = {**UNIFORM, "options": {"kv_layer_dtypes": "0-3:fp8_e4m3", "quantize_query": "decode"}}


def test_layer_set_values_keep_their_commas():
    assert parse_selector("kv_dtype=nvfp4,kv_dtype_skip_layers=0,1,31,concurrency=4") == {
        "kv_dtype": "nvfp4", "kv_dtype_skip_layers": "0,1,31", "concurrency": "4"}
    with pytest.raises(ValueError, match="not key=value"):
        parse_selector("kv_dtype=nvfp4,0")


def test_options_match_canonically_and_none_means_unset():
    assert matches(SKIP, parse_selector("kv_dtype=nvfp4,kv_dtype_skip_layers=31,30,29,28,1,0"))
    assert not matches(UNIFORM, parse_selector("kv_dtype_skip_layers=0,1,28-31"))
    assert matches(UNIFORM, parse_selector("kv_dtype=nvfp4,kv_dtype_skip_layers=none"))
    assert not matches(SKIP, parse_selector("kv_dtype_skip_layers=none"))
    assert matches(MIXED, parse_selector("kv_layer_dtypes=0-3:fp8_e4m3,quantize_query=decode"))
    assert not matches(MIXED, parse_selector("quantize_query=prefill"))
    assert not matches(SKIP, {"no_such_key": "x"})


def _cell(key, cfg):
    return CellData(key=key, config=cfg, label=key, status="done")


def test_reproduce_selector_tells_skip_cells_apart():
    cells = [_cell("u", UNIFORM), _cell("s", SKIP), _cell("x", {**UNIFORM, "kv_dtype": "fp8_e4m3"})]
    sels = {c.key: cell_selector(c, cells) for c in cells}
    assert sels == {"u": "kv_dtype=nvfp4,kv_dtype_skip_layers=none", "s": "kv_dtype=nvfp4,kv_dtype_skip_layers=0,1,28-31",
                    "x": "kv_dtype=fp8_e4m3"}
    for c in cells:  # each selector picks its own cell alone
        picked = [o.key for o in cells if matches(o.config, parse_selector(sels[c.key]))]
        assert picked == [c.key]


def test_sweep_only_takes_option_keys():
    from kvbench.harness.matrix import expand, select
    from kvbench.harness.sweep.config import SweepConfigError, parse_config

    cfg = parse_config({"model": "synthetic:llama-3-8b,layers=4", "axes": {"kv": [
        {"dtype": "fp8_e4m3", "scales": "calibrate"}, {"dtype": "fp8_e4m3", "scales": "calibrate", "kv_dtype_skip_layers": [3, 0]}]},
        "load": {"enabled": False}})
    cells = expand(cfg)
    assert [c.config.get("options") for c in select(cells, "kv_dtype_skip_layers=0,3")] == [{"kv_dtype_skip_layers": "0,3"}]
    assert [c.config.get("options") for c in select(cells, "kv_dtype_skip_layers=none")] == [None]
    with pytest.raises(SweepConfigError, match="unknown cell key 'bogus'"):
        select(cells, "bogus=1")


def test_sweep_baseline_may_name_kv_options():
    from kvbench.harness.matrix import expand
    from kvbench.harness.sweep.config import SweepConfigError, parse_config

    raw = {"model": "synthetic:llama-3-8b,layers=4", "load": {"enabled": False}, "suites": ["fidelity"],
           "axes": {"kv": [{"dtype": "fp8_e4m3", "scales": "calibrate"},
                           {"dtype": "fp8_e4m3", "scales": "calibrate", "kv_dtype_skip_layers": [3, 0]}]},
           "baseline": {"kv_dtype": "fp8_e4m3", "kv_dtype_skip_layers": [3, 0]}}
    cfg = parse_config(raw)
    assert cfg.baseline == {"kv_dtype": "fp8_e4m3", "kv_dtype_skip_layers": "0,3"}
    aa = [c for c in expand(cfg) if c.config.get("aa_control")]
    assert len(aa) == 1 and aa[0].config["options"] == {"kv_dtype_skip_layers": "0,3"}  # the A/A copies the skip cell
    uniform = parse_config({**raw, "baseline": {"kv_dtype": "fp8_e4m3", "kv_dtype_skip_layers": "none"}})
    aa = [c for c in expand(uniform) if c.config.get("aa_control")]
    assert "options" not in aa[0].config
    with pytest.raises(SweepConfigError, match="baseline.kv_dtype_skip_layers: 'x' is not a layer index"):
        parse_config({**raw, "baseline": {"kv_dtype_skip_layers": "x"}})
