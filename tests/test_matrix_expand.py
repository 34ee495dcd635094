"""Matrix expansion: cell count, canonical keys, grouping for engine reuse, --only selection."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbench.harness.matrix import engine_options, expand, groups, select
from kvbench.core.io import canonical_key
from kvbench.harness.sweep.config import CELL_KEYS, SweepConfigError, load_config, parse_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def sweep(**over):
    raw = {
        "engine": {"device": "cpu", "max_running": 8},
        "axes": {
            "backends": ["torch", "torch+triton", {"prefill": "triton", "decode": "torch"}],
            "kv": ["bf16", {"dtype": "nvfp4", "scales": "calibrate"}, {"dtype": "fp8_e4m3", "scales": "unit", "quantize_query": True}],
            "concurrency": [1, 4, 16],
        },
        "accuracy_concurrency": 4,
    }
    raw.update(over)
    return parse_config(raw)


def test_cell_count_order_and_keys():
    cells = expand(sweep())
    assert len(cells) == 3 * 3 * 3
    assert [c.index for c in cells] == list(range(27))
    for c in cells:
        assert set(CELL_KEYS) <= set(c.config)
        assert c.key == canonical_key(c.config)
    assert len({c.key for c in cells}) == 27
    # axes order: backends, then kv, then concurrency (innermost)
    assert [c.concurrency for c in cells[:3]] == [1, 4, 16]
    assert cells[0].config["prefill_backend"] == "torch" and cells[9].config["prefill_backend"] == "torch"
    assert (cells[9].config["decode_backend"], cells[18].config["decode_backend"]) == ("triton", "torch")
    assert cells[9].label == "bf16/unit torch+triton c=1"
    q = [c for c in cells if c.config.get("options")]
    assert len(q) == 9 and all(c.config["options"] == {"quantize_query": True} for c in q)
    assert "+quantize_query" in q[0].label


def test_keys_are_stable_across_expansions_and_axis_order():
    a = expand(sweep())
    b = expand(sweep(axes={"backends": ["torch"], "kv": ["bf16"], "concurrency": [16, 1]}, accuracy_concurrency=1))
    by_key = {c.key: c.config for c in a}
    for c in b:
        assert by_key[c.key] == c.config


def test_accuracy_runs_in_exactly_one_cell_per_group():
    cells = expand(sweep())
    gs = groups(cells)
    assert len(gs) == 9
    for g in gs:
        assert len({c.group for c in g}) == 1 and [c.concurrency for c in g] == [1, 4, 16]
        assert [c.run_accuracy for c in g] == [False, True, False]


def test_groups_only_merge_neighbours():
    cells = expand(sweep())
    odd = [cells[0], cells[3], cells[1]]  # group A, group B, group A again
    assert [len(g) for g in groups(odd)] == [1, 1, 1]


def test_select():
    cells = expand(sweep())
    sel = select(cells, "kv_dtype=nvfp4,concurrency=16")
    assert len(sel) == 3 and all(c.config["kv_dtype"] == "nvfp4" and c.concurrency == 16 for c in sel)
    assert select(cells, None) == cells
    with pytest.raises(SweepConfigError, match="unknown cell key 'format'.*kv_dtype"):
        select(cells, "format=nvfp4")
    with pytest.raises(SweepConfigError, match="matches no cell.*'kv_dtype': \\['bf16', 'fp8_e4m3', 'nvfp4'\\]"):
        select(cells, "kv_dtype=fp16")
    with pytest.raises(SweepConfigError, match="not key=value"):
        select(cells, "nvfp4")


def test_engine_options_merge_sweep_target_and_cell():
    cfg = sweep(targets=[{"name": "e", "type": "embedded", "engine": {"max_running": 2, "dtype": "float32"}}])
    cell = [c for c in expand(cfg) if c.config.get("options")][0]
    opts = engine_options(cfg, cell)
    assert opts["device"] == "cpu" and opts["max_running"] == 2 and opts["dtype"] == "float32"
    assert opts["model"] is None  # "default" -> the engine's default model
    assert (opts["kv_dtype"], opts["kv_scales"], opts["quantize_query"]) == ("fp8_e4m3", "unit", True)
    from kvbench.runtime.config import EngineConfig

    EngineConfig(**opts)  # every option is a real EngineConfig field


def test_default_config_matrix():
    cells = expand(load_config(CONFIGS / "default.yaml"))
    assert len(cells) == 10  # 3 formats x 3 concurrencies + the A/A control (on by default)
    assert len(groups(cells)) == 4  # the A/A control runs last, in a fresh engine
    assert sum(c.run_accuracy for c in cells) == 4
    aa = cells[-1]
    assert aa.config["aa_control"] is True and aa.config["kv_dtype"] == "bf16" and aa.config["concurrency"] == 8


def test_aa_control_adds_one_copy_of_the_baseline_accuracy_cell():
    from kvbench.harness.matrix import expand
    from kvbench.harness.sweep.config import SweepConfigError, parse_config

    raw = {"axes": {"kv": ["bf16", "fp8_e4m3"], "concurrency": [1, 4]}, "accuracy_concurrency": 4,
           "baseline": {"kv_dtype": "bf16"}, "aa_control": True, "suites": [{"name": "gsm8k", "limit": 2}]}
    cells = expand(parse_config(raw))
    assert len(cells) == 5
    aa = cells[-1]
    assert aa.config["aa_control"] is True and aa.run_accuracy
    base = [c for c in cells[:-1] if c.config["kv_dtype"] == "bf16" and c.run_accuracy][0]
    # the same cell under different batching: half the accuracy concurrency unless aa_concurrency says
    assert aa.config["concurrency"] == 2 and aa.label.endswith("c=2 A/A")
    assert {k: v for k, v in aa.config.items() if k not in ("aa_control", "concurrency")} == \
        {k: v for k, v in base.config.items() if k != "concurrency"} and aa.key != base.key
    assert expand(parse_config({**raw, "aa_concurrency": 3}))[-1].config["concurrency"] == 3
    assert expand(parse_config({**raw, "accuracy_concurrency": 1}))[-1].config["concurrency"] == 2
    assert len(expand(parse_config({**raw, "aa_control": False}))) == 4
    raw_default = {k: v for k, v in raw.items() if k != "aa_control"}
    assert len(expand(parse_config(raw_default))) == 5  # on by default with suites
    assert len(expand(parse_config({**raw_default, "suites": []}))) == 4  # nothing to repeat without suites
    import pytest

    with pytest.raises(SweepConfigError, match="aa_control"):
        parse_config({**raw, "aa_control": "yes"})


def test_a_pair_the_engine_cannot_run_is_refused_at_load():
    """The backend table says flashinfer decodes no nvfp4: a product that contains that pair is a config error
    naming the pair and pointing at axes.combos (before, its cells failed one by one when they started)."""
    with pytest.raises(SweepConfigError, match=r"(?s)axes: .*triton\+flashinfer x nvfp4: the flashinfer backend does "
                                                r"not run nvfp4 for decode.*axes\.combos"):
        sweep(axes={"backends": ["torch", "triton+flashinfer"], "kv": ["bf16", {"dtype": "nvfp4", "scales": "calibrate"}],
                    "concurrency": [4]})
    # the same matrix as explicit combinations without the pair loads, and its cells keep their keys
    ok = sweep(axes={"combos": [{"backends": "torch", "kv": "bf16"}, {"backends": "torch", "kv": {"dtype": "nvfp4", "scales": "calibrate"}},
                                {"backends": "triton+flashinfer", "kv": "bf16"}], "concurrency": [4]})
    product = sweep(axes={"backends": ["torch", "triton+flashinfer"], "kv": ["bf16"], "concurrency": [4]})
    assert {c.key for c in expand(product)} <= {c.key for c in expand(ok)}


def test_aa_control_for_candidates():
    """``aa_control: all`` reruns every accuracy cell (each candidate's own noise floor), a list of selectors
    the baseline's and those; each control runs in a fresh engine (its own group), after every other cell."""
    import pytest

    from kvbench.harness.matrix import expand
    from kvbench.harness.sweep.config import SweepConfigError, parse_config

    raw = {"axes": {"kv": ["bf16", "fp8_e4m3", "nvfp4"], "concurrency": [1, 4]}, "accuracy_concurrency": 4,
           "baseline": {"kv_dtype": "bf16"}, "suites": [{"name": "gsm8k", "limit": 2}]}
    cells = expand(parse_config({**raw, "aa_control": "all"}))
    controls = [c for c in cells if c.config.get("aa_control")]
    assert [c.config["kv_dtype"] for c in controls] == ["bf16", "fp8_e4m3", "nvfp4"]
    assert cells[-3:] == controls and all(c.config["concurrency"] == 2 and not c.run_load for c in controls)
    originals = {c.config["kv_dtype"]: c for c in cells if c.run_accuracy and not c.config.get("aa_control")}
    for c in controls:
        assert c.group != originals[c.config["kv_dtype"]].group  # never the original's engine
        assert c.label == originals[c.config["kv_dtype"]].label.replace("c=4", "c=2") + " A/A"
    listed = expand(parse_config({**raw, "aa_control": ["kv_dtype=nvfp4"]}))
    assert [c.config["kv_dtype"] for c in listed if c.config.get("aa_control")] == ["bf16", "nvfp4"]
    for bad in ("some", ["kv_dtype"], []):
        with pytest.raises(SweepConfigError, match="aa_control"):
            parse_config({**raw, "aa_control": bad})
