"""KVConfig (kvbench.core.kv_config): one typed KV configuration for sweep entries, cells, EngineConfig, launches,
selectors and labels; and a toy option registered in core alone reaching every one of those places (the recipe
of docs/architecture.md "Adding a KV option")."""

from __future__ import annotations

import pytest

from kvbench.core.io import canonical_key
from kvbench.core.kv_config import KVConfig, KVOption, kv_option_names, register_kv_option, unregister_kv_option
from kvbench.core.store import matches, parse_selector
from kvbench.harness.matrix import engine_options, expand, groups
from kvbench.harness.sweep.config import SweepConfigError, parse_config
from kvbench.harness.targets import render_launch
from kvbench.reports.load import CellData, assign_short_labels
from kvbench.runtime.config import EngineConfig


def test_spellings_canonicalize_to_one_configuration_and_key():
    a = KVConfig.make("nvfp4", "calibrate", {"kv_dtype_skip_layers": [31, 0, 1], "quantize_query": "Both"})
    b = KVConfig.make("nvfp4", "calibrate", {"quantize_query": True, "kv_dtype_skip_layers": "1,0,31"})
    assert a == b and a.key() == b.key()
    assert a.options == (("kv_dtype_skip_layers", "0,1,31"), ("quantize_query", True))
    assert KVConfig.make("nvfp4", options={"kv_dtype_skip_layers": []}) == KVConfig.make("nvfp4")  # nothing skipped
    with pytest.raises(ValueError, match="quantize_query"):
        KVConfig.make("fp8_e4m3", options={"quantize_query": "sometimes"})
    with pytest.raises(ValueError, match="unknown KV option 'nope'"):
        KVConfig.make("fp8_e4m3", options={"nope": 1})


def test_dict_forms_round_trip_and_the_cell_form_keeps_old_keys():
    kv = KVConfig.make("fp8_e4m3", "checkpoint", {"quantize_query": "decode", "fused_append": False},
                       "triton", "torch", "/s/scales.json")
    assert KVConfig.from_dict(kv.to_dict()) == kv
    cell = {"model": "m", "target": "t", **kv.cell_fields(), "concurrency": 4}
    assert KVConfig.from_cell(cell) == kv
    # the cell dict a sweep wrote before KVConfig existed: same keys, same canonical key
    old = {"model": "m", "target": "t", "prefill_backend": "triton", "decode_backend": "torch", "kv_dtype": "fp8_e4m3",
           "kv_scales": "checkpoint", "concurrency": 4, "options": {"fused_append": False, "quantize_query": "decode"},
           "scales_file": "/s/scales.json"}
    assert canonical_key(cell) == canonical_key(old)
    assert kv.label() == "fp8_e4m3/checkpoint@scales.json+quantize_query=decode" and kv.backend_label == "triton+torch"


def test_engine_config_takes_a_kv_configuration_and_the_reference():
    kv = KVConfig.make("nvfp4", "calibrate", {"kv_dtype_skip_layers": "0,31", "quantize_query": "decode"}, "triton", "triton")
    eng = EngineConfig().with_kv(kv)
    assert (eng.kv_dtype, eng.kv_scales, eng.kv_dtype_skip_layers, eng.quantize_query, eng.decode_backend) == (
        "nvfp4", "calibrate", "0,31", "decode", "triton")
    assert eng.kv == kv
    ref = eng.with_kv(eng.kv.reference(backend="torch"))
    assert ref.kv == KVConfig("bf16", "unit", (), "torch", "torch") and ref.kv.is_reference
    assert (ref.kv_dtype_skip_layers, ref.quantize_query, ref.fused_append) == (None, "none", True)


# ------------------------------------------------------------------------------ a toy option
@pytest.fixture
def toy():
    opt = register_kv_option(KVOption("toy_rounding", False, lambda v: v if isinstance(v, bool) else
                                      {"true": True, "false": False}[str(v).lower()], boolean=True,
                                      launch_text=lambda v: "true" if v else "false",
                                      help="a test-only option: rounding mode of a format that does not exist"))
    yield opt
    unregister_kv_option("toy_rounding")


def _sweep(target: dict) -> dict:
    return {"targets": [target], "axes": {"kv": ["bf16", {"dtype": "fp8_e4m3", "toy_rounding": True}],
                                          "concurrency": [1, 4]}, "baseline": {"kv_dtype": "bf16"}}


def test_a_toy_option_registered_in_core_reaches_cells_labels_selectors_launches(toy):
    assert "toy_rounding" in kv_option_names()
    launch = "vllm serve m --port {port} --kv-cache-dtype {kv_dtype}"
    target = {"name": "srv", "type": "server", "launch": launch, "option_flags": {"toy_rounding": "--toy {value}"}}
    cfg = parse_config(_sweep(target))
    cells = expand(cfg)
    toy_cells = [c for c in cells if c.config["kv_dtype"] == "fp8_e4m3"]
    assert [c.config["options"] for c in toy_cells] == [{"toy_rounding": True}] * 2
    assert toy_cells[0].kv.option("toy_rounding") is True and toy_cells[0].kv_label == "fp8_e4m3/unit+toy_rounding"
    plain = canonical_key({k: v for k, v in toy_cells[0].config.items() if k != "options"})
    assert toy_cells[0].key != plain  # the option is part of the cell's identity
    # selectors: the option by name, "none" for cells without it
    assert matches(toy_cells[0].config, parse_selector("kv_dtype=fp8_e4m3,toy_rounding=true"))
    assert matches(cells[0].config, parse_selector("toy_rounding=none"))
    assert parse_config({**_sweep(target), "baseline": {"toy_rounding": False}}).baseline == {"toy_rounding": "false"}
    # the launch carries it, and only where the cell sets it
    cmds = {g[0].config["kv_dtype"]: render_launch(cfg.target("srv"), g[0].config, 9000) for g in groups(cells)}
    assert cmds["fp8_e4m3"].endswith("--toy true") and "--toy" not in cmds["bf16"]
    # report labels
    data = [CellData(key=c.key, config=c.config, label=c.label, status="done") for c in cells]
    assign_short_labels(data)
    assert [d.short for d in data] == ["bf16 c=1", "bf16 c=4", "fp8_e4m3 c=1 +toy_rounding", "fp8_e4m3 c=4 +toy_rounding"]


def test_a_toy_option_is_refused_where_nothing_acts_on_it(toy):
    launch = "vllm serve m --port {port} --kv-cache-dtype {kv_dtype}"
    with pytest.raises(SweepConfigError, match="toy_rounding"):  # a server whose launch cannot carry it
        parse_config(_sweep({"name": "srv", "type": "server", "launch": launch}))
    with pytest.raises(SweepConfigError, match="embedded engine does not act on toy_rounding"):
        parse_config(_sweep({"name": "e", "type": "embedded"}))
    with pytest.raises(SweepConfigError, match="toy_rounding"):  # YAML booleans only, as for every boolean option
        parse_config({**_sweep({"name": "srv", "type": "server", "launch": launch,
                                "option_flags": {"toy_rounding": "--toy {value}"}}),
                      "axes": {"kv": [{"dtype": "fp8_e4m3", "toy_rounding": "maybe"}]}})


def test_embedded_cells_build_their_engine_config_from_the_cell_kv():
    cfg = parse_config({"targets": [{"name": "e", "type": "embedded"}],
                        "axes": {"kv": [{"dtype": "nvfp4", "kv_dtype_skip_layers": [3, 0], "quantize_query": "prefill"}],
                                 "backends": ["triton"]}})
    cell = expand(cfg)[0]
    eng = EngineConfig(**engine_options(cfg, cell))
    assert eng.kv == cell.kv.with_options() and eng.kv_dtype_skip_layers == "0,3" and eng.quantize_query == "prefill"
