"""Mixed per-layer KV formats everywhere a user sets a KV format: the canonical spellings, the engine flags of
`eval` / `serve` (EngineConfig, one-line usage errors), sweep KV entries (canonical cell keys and labels, errors
at their key path, layers checked against models known before they load), server launches (vLLM's list,
SGLang refused), `kvbench capacity`'s mixed row, and what reports show."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import typer
import yaml
from typer.testing import CliRunner

from kvbench.core.layer_formats import (canonical_layer_dtypes, canonical_skip_layers, mixed_bytes_per_token,
                                        resolve_layer_dtypes)
from kvbench.harness.cli import app
from kvbench.harness.commands.capacity import capacity_rows
from kvbench.harness.config_checks import SweepConfigError
from kvbench.harness.launch.options import render_command
from kvbench.harness.matrix import engine_options, expand
from kvbench.harness.options import engine_options as engine_flags
from kvbench.harness.sweep.config import parse_config
from kvbench.runtime.config import EngineConfig

SYN = "synthetic:llama-3-8b,layers=4"

# ------------------------------------------------------------------------------ canonical forms


@pytest.mark.parametrize("value, canon", [
    ([31, 0, 1], "0,1,31"), ("0,1,31", "0,1,31"), ("1,0,31", "0,1,31"), ("31 1 0", "0,1,31"),
    ("0-3", "0-3"), ([0, 1, 2, 3], "0-3"), ("0,1", "0,1"), ("swa,2", "2,sliding_window"),
    ("sliding", "sliding_window"), (7, "7"), ([], None), ("", None), (None, None),
])
def test_skip_layers_canonical(value, canon):
    assert canonical_skip_layers(value) == canon


def test_layer_dtypes_canonical_and_errors():
    assert canonical_layer_dtypes("31:bf16;0-3:fp8") == "0-3:fp8_e4m3;31:bf16"
    assert canonical_layer_dtypes({"31": "bf16", "2,0,1,3": "fp8_e4m3"}) == "0-3:fp8_e4m3;31:bf16"
    with pytest.raises(ValueError, match="'fp9' is not a KV format; choose one of: bf16"):
        canonical_layer_dtypes("0:fp9")
    with pytest.raises(ValueError, match="layer 1 is given two formats"):
        canonical_layer_dtypes("0-2:nvfp4;1:bf16")
    with pytest.raises(ValueError, match="'x' is not a layer index"):
        canonical_skip_layers("0,x")
    with pytest.raises(ValueError, match="layer 4 is not a layer of this model"):
        resolve_layer_dtypes("fp8_e4m3", 4, "4")


# ------------------------------------------------------------------------------ command line

_seen: list = []
_app = typer.Typer()


@_app.command("run")
@engine_flags
def _run(engine) -> None:
    _seen.append(engine)


@_app.command("other")
def _other() -> None:
    pass


def config_of(*argv) -> EngineConfig:
    _seen.clear()
    r = CliRunner().invoke(_app, ["run", "--device", "cpu", *map(str, argv)])
    assert r.exit_code == 0, r.output
    return _seen[-1]


def test_flags_set_engine_config_canonically():
    a = config_of("--kv-dtype", "fp8", "--kv-dtype-skip-layers", "31,1,0")
    b = config_of("--kv-dtype", "fp8_e4m3", "--kv-cache-dtype-skip-layers", "0 1 31")
    assert a == b and a.kv_dtype_skip_layers == "0,1,31" and a.kv_layer_dtypes is None
    c = config_of("--kv-layer-dtypes", "31:bf16;0-3:nvfp4", "--model", SYN.replace("layers=4", "layers=32"))
    assert c.kv_layer_dtypes == "0-3:nvfp4;31:bf16" and c.kv_dtype_skip_layers is None
    assert config_of().kv_dtype_skip_layers is None


def one_line_error(*argv) -> str:
    r = CliRunner().invoke(app, list(argv))
    text = r.stdout + (r.stderr or "")
    lines = [x for x in text.splitlines() if x.strip()]
    assert r.exit_code == 2 and len(lines) == 1, text
    return lines[0]


@pytest.mark.parametrize("cmd", ["eval", "serve"])
def test_bad_layer_flags_are_one_line_usage_errors(cmd):
    line = one_line_error(cmd, "--kv-dtype", "fp8", "--kv-dtype-skip-layers", "0,x")
    assert line == (f"kvbench {cmd}: error: Invalid value for '--kv-dtype-skip-layers': 'x' is not a layer index, a "
                    "range a-b or a pattern (sliding_window, full_attention)")
    line = one_line_error(cmd, "--kv-layer-dtypes", "0-3:fp9")
    assert line.startswith(f"kvbench {cmd}: error: Invalid value for '--kv-layer-dtypes': 'fp9' is not a KV format")
    # the model's layers are known before it loads (synthetic): refused now, naming the flag used
    line = one_line_error(cmd, "--model", SYN, "--kv-cache-dtype-skip-layers", "1 0 40")
    assert line == (f"kvbench {cmd}: error: Invalid value for '--kv-cache-dtype-skip-layers': layer 40 is not a layer "
                    f"of {SYN} (it has 4: 0..3)")
    line = one_line_error(cmd, "--model", SYN, "--kv-dtype-skip-layers", "sliding_window")
    assert "the pattern sliding_window matches no layer" in line


def test_local_model_dir_layers_are_checked(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 6, "num_attention_heads": 4,
           "num_key_value_heads": 2, "hidden_size": 256, "intermediate_size": 512, "vocab_size": 300}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert config_of("--model", tmp_path, "--kv-dtype-skip-layers", "0-5").kv_dtype_skip_layers == "0-5"
    line = one_line_error("eval", "--model", str(tmp_path), "--kv-layer-dtypes", "6:nvfp4")
    assert line.endswith(f"'--kv-layer-dtypes': 6:nvfp4: layer 6 is not a layer of {tmp_path} (it has 6: 0..5)")


# ------------------------------------------------------------------------------ sweep configs

SWEEP = """
model: {model}
axes:
  kv:
    - bf16
    - {{dtype: fp8_e4m3, scales: calibrate}}
    - {{dtype: fp8_e4m3, quantize_query: decode}}
    - {{dtype: fp8_e4m3, scales: calibrate, kv_dtype_skip_layers: {skip}}}
    - {{dtype: fp8_e4m3, kv_layer_dtypes: "3:bf16;0-1:nvfp4"}}
  concurrency: [1, 4]
"""
# keys of cells without the per-layer options, as recorded before the options existed: they must not move
OLD_KEYS = {("bf16", 1): "84cbf8a6774e", ("bf16", 4): "95a74570c66c", ("fp8_e4m3/calibrate", 1): "e642f26ead76",
            ("fp8_e4m3/calibrate", 4): "f97dcc112257", ("fp8_e4m3/unit+quantize_query=decode", 1): "cf5127ef1da1",
            ("fp8_e4m3/unit+quantize_query=decode", 4): "646e4677142b"}


def cells_of(skip, model=SYN):
    return expand(parse_config(yaml.safe_load(SWEEP.format(model=model, skip=skip))))


def test_sweep_skip_layers_round_trip_and_keys():
    spellings = ["[3, 0, 1]", '"0,1,3"', '"1,0,3"', '"0-1,3"']
    runs = [cells_of(s) for s in spellings]
    assert len({tuple(c.key for c in cells) for cells in runs}) == 1  # one cell per set, whatever the spelling
    cells = runs[0]
    skip = [c for c in cells if "kv_dtype_skip_layers" in c.config.get("options", {})]
    assert [c.config["options"] for c in skip] == [{"kv_dtype_skip_layers": "0,1,3"}] * 2
    assert skip[0].label == "fp8_e4m3/calibrate skip 0,1,3 torch c=1"
    mixed = [c for c in cells if "kv_layer_dtypes" in c.config.get("options", {})]
    assert mixed[0].config["options"] == {"kv_layer_dtypes": "0,1:nvfp4;3:bf16"}
    assert mixed[0].label == "fp8_e4m3/unit layers 0,1:nvfp4;3:bf16 torch c=1"
    old = {(c.kv_label.replace("/unit", "") if c.config["kv_dtype"] == "bf16" else c.kv_label, c.concurrency): c.key
           for c in cells if c not in skip and c not in mixed}
    assert old == OLD_KEYS
    # the options land in the engine config of the cell
    sweep = parse_config(yaml.safe_load(SWEEP.format(model=SYN, skip="[3, 0, 1]")))
    eng = EngineConfig(**engine_options(sweep, skip[0]))
    assert (eng.kv_dtype, eng.kv_scales, eng.kv_dtype_skip_layers, eng.kv_layer_dtypes) == ("fp8_e4m3", "calibrate", "0,1,3", None)
    assert EngineConfig(**engine_options(sweep, mixed[0])).kv_layer_dtypes == "0,1:nvfp4;3:bf16"


def test_two_spellings_of_one_set_are_one_entry():
    with pytest.raises(SweepConfigError, match="axes.kv: duplicate entries"):
        parse_config({"axes": {"kv": [{"dtype": "fp8", "kv_dtype_skip_layers": "3,0"},
                                      {"dtype": "fp8_e4m3", "kv_dtype_skip_layers": [0, 3]}]}})


def test_empty_skip_set_is_the_uniform_cell():
    raw = {"model": SYN, "axes": {"kv": [{"dtype": "fp8_e4m3", "kv_dtype_skip_layers": []}]}}
    [cell] = expand(parse_config(raw))
    assert "options" not in cell.config and cell.key == expand(parse_config({"model": SYN, "axes": {"kv": ["fp8_e4m3"]}}))[0].key


@pytest.mark.parametrize("entry, message", [
    ({"kv_dtype_skip_layers": "0,x"}, "axes.kv[1].kv_dtype_skip_layers: 'x' is not a layer index"),
    ({"kv_dtype_skip_layers": True}, "axes.kv[1].kv_dtype_skip_layers: expected layer indices"),
    ({"kv_layer_dtypes": "0:fp9"}, "axes.kv[1].kv_layer_dtypes: 'fp9' is not a KV format; choose one of: bf16"),
    ({"kv_layer_dtypes": "0-2:nvfp4", "kv_dtype_skip_layers": [2]},
     "axes.kv[1]: layer 2 is in kv_dtype_skip_layers and kv_layer_dtypes; give it once"),
    ({"kv_dtype_skip_layers": [40]}, f"axes.kv[1].kv_dtype_skip_layers: layer 40 is not a layer of {SYN} (it has 4: 0..3)"),
    ({"kv_layer_dtypes": "7:nvfp4"}, f"axes.kv[1].kv_layer_dtypes: 7:nvfp4: layer 7 is not a layer of {SYN}"),
    ({"kv_dtype_skip_layers": "swa"}, "axes.kv[1].kv_dtype_skip_layers: the pattern sliding_window matches no layer"),
])
def test_sweep_errors_name_the_key_path(entry, message):
    with pytest.raises(SweepConfigError) as e:
        parse_config({"model": SYN, "axes": {"kv": ["bf16", {"dtype": "fp8_e4m3", **entry}]}})
    assert str(e.value).startswith(message), str(e.value)


def test_layers_of_unknown_models_wait_for_the_engine():
    # the default model (and hub ids, presets) load later: the engine checks the layers when it starts
    raw = {"axes": {"kv": [{"dtype": "fp8_e4m3", "kv_dtype_skip_layers": [400]}]}}
    assert expand(parse_config(raw))[0].config["options"] == {"kv_dtype_skip_layers": "400"}
    with pytest.raises(SweepConfigError, match="unknown key 'kv_dtype_skip_layers'"):  # per cell: set on the axes
        parse_config({"engine": {"kv_dtype_skip_layers": "0"}})


# ------------------------------------------------------------------------------ server launches

VLLM = "vllm serve {model} --port {port} --kv-cache-dtype {kv_dtype}"
SGLANG = "python -m sglang.launch_server --model-path {model} --port {port} --kv-cache-dtype {kv_dtype}"


def server_sweep(launch: str, kv: list, **target) -> dict:
    return {"model": "m", "targets": [{"name": "t", "type": "server", "launch": launch, **target}], "axes": {"kv": kv}}


def test_vllm_launch_renders_the_skip_list():
    raw = server_sweep(VLLM, ["fp8_e4m3", {"dtype": "fp8_e4m3", "kv_dtype_skip_layers": "0-2,31,swa"}],
                       option_flags={"kv_skip_layers": "--kv-cache-dtype-skip-layers {value}"})
    sweep = parse_config(raw)
    plain, skip = (render_command(sweep.targets[0], c.config, 8000) for c in expand(sweep))
    assert plain == "vllm serve m --port 8000 --kv-cache-dtype fp8_e4m3"  # nothing for the uniform entry
    assert skip == plain + " --kv-cache-dtype-skip-layers 0 1 2 31 sliding_window"
    # the placeholder: every entry must set a skip set
    raw = server_sweep(VLLM + " --kv-cache-dtype-skip-layers {kv_skip_layers}", [{"dtype": "fp8", "kv_dtype_skip_layers": [1, 0]}])
    sweep = parse_config(raw)
    assert render_command(sweep.targets[0], expand(sweep)[0].config, 1).endswith("--kv-cache-dtype-skip-layers 0 1")
    with pytest.raises(SweepConfigError, match=r"axes.kv\[0\].kv_dtype_skip_layers: target 't' \(targets\[0\]\) passes "
                                               r"\{kv_skip_layers\} in its launch template, but this entry sets no"):
        parse_config(server_sweep(VLLM + " --kv-cache-dtype-skip-layers {kv_skip_layers}", ["fp8_e4m3"]))


def test_a_kvbench_target_gets_one_word():
    raw = server_sweep("kvbench serve --port {port} --kv-dtype {kv_dtype} --kv-dtype-skip-layers {kv_skip_layers}",
                       [{"dtype": "fp8", "kv_dtype_skip_layers": "3,1,2"}])
    sweep = parse_config(raw)
    assert render_command(sweep.targets[0], expand(sweep)[0].config, 1).endswith("--kv-dtype-skip-layers 1-3")


@pytest.mark.parametrize("launch, entry, message", [
    (SGLANG, {"kv_dtype_skip_layers": [0, 1]},
     "axes.kv[1].kv_dtype_skip_layers: kv_skip_layers '0,1' does not reach target 't' (targets[0]): sglang has no flag"),
    (SGLANG, {"kv_layer_dtypes": "0:bf16"},
     "axes.kv[1].kv_layer_dtypes: kv_layer_dtypes '0:bf16' does not reach target 't' (targets[0]): sglang has no flag"),
    (VLLM, {"kv_layer_dtypes": "0:bf16"}, "axes.kv[1].kv_layer_dtypes: kv_layer_dtypes '0:bf16' does not reach"),
    (VLLM, {"kv_dtype_skip_layers": [0]}, "axes.kv[1].kv_dtype_skip_layers: kv_skip_layers '0' does not reach target "
                                          "'t' (targets[0]): its launch has no {kv_skip_layers}"),
    (VLLM + " --kv-cache-dtype-skip-layers {kv_skip_layers}", {"kv_dtype_skip_layers": "full_attention"},
     "axes.kv[1].kv_dtype_skip_layers: target 't' (targets[0]): vLLM's --kv-cache-dtype-skip-layers takes"),
])
def test_options_that_cannot_reach_the_server_are_refused(launch, entry, message):
    kv = [{"dtype": "fp8_e4m3", "kv_dtype_skip_layers": [5]}] if "{kv_skip_layers}" in launch else ["fp8_e4m3"]
    with pytest.raises(SweepConfigError) as e:
        parse_config(server_sweep(launch, [*kv, {"dtype": "fp8_e4m3", **entry}]))
    assert str(e.value).startswith(message), str(e.value)


def test_layer_option_flags_take_a_template_only():
    with pytest.raises(SweepConfigError, match="a layer list cannot key a mapping"):
        parse_config(server_sweep(VLLM, ["fp8_e4m3"], option_flags={"kv_skip_layers": {"0": "--x"}}))


# ------------------------------------------------------------------------------ kvbench capacity


def test_capacity_mixed_row_equals_hand_computation():
    rows = capacity_rows("llama-3-8b", 40.0, 4096, 16, kv_dtype="fp8", skip_layers="31,0,1")
    names = [r["name"] for r in rows]
    assert names[names.index("fp8_e4m3") + 1] == "fp8_e4m3 skip 0,1,31"  # beside its uniform row
    row = rows[names.index("fp8_e4m3 skip 0,1,31")]
    per_layer_bf16, per_layer_fp8 = 2 * 8 * 128 * 2, 2 * 8 * 128 * 1  # K and V planes, 8 kv heads, head_dim 128
    bpt = 3 * per_layer_bf16 + 29 * per_layer_fp8
    assert row["bytes_per_token"] == bpt == 71680
    pages = 40 * 2**30 // (bpt * 16)
    assert (row["num_pages"], row["tokens"], row["max_concurrency"]) == (pages, pages * 16, pages // 256)
    assert row["layer_formats"] == {"bf16": 3, "fp8_e4m3": 29} and row["kv_dtype_skip_layers"] == "0,1,31"
    assert math.isclose(row["bytes_vs_first"], bpt / (32 * per_layer_bf16))


def test_capacity_sliding_windows_and_layer_dtypes(tmp_path):
    [row] = [r for r in capacity_rows("gpt-oss-20b", 10.0, 4096, kv_dtype="fp8_e4m3", skip_layers="sliding_window")
             if r["name"].endswith("skip sliding_window")]
    assert row["bytes_per_token"] == 12 * (2 * 8 * 64 * 2) + 12 * (2 * 8 * 64)  # the 12 windowed layers in bf16
    layers = resolve_layer_dtypes("fp8_e4m3", 32, layer_dtypes="0-3:nvfp4;31:bf16")
    [row] = [r for r in capacity_rows("llama-3-8b", 40.0, 4096, kv_dtype="fp8_e4m3", layer_dtypes="31:bf16;0-3:nvfp4")
             if r.get("kv_layer_dtypes")]
    assert row["bytes_per_token"] == mixed_bytes_per_token(layers, 8, 128)
    assert row["name"] == "fp8_e4m3 (nvfp4 on 0-3; bf16 on 31)"
    cfg = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "hidden_size": 512,
           "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    [row] = [r for r in capacity_rows("x", 1.0, 4096, model_config=str(tmp_path), skip_layers="sliding")
             if r.get("kv_dtype_skip_layers")]
    assert row["bytes_per_token"] == 2 * (2 * 2 * 64 * 2) + 2 * (2 * 2 * 64)


@pytest.mark.parametrize("argv, message", [
    (["--kv-dtype-skip-layers", "40"], "kvbench capacity: error: --kv-dtype-skip-layers: layer 40 is not a layer of "
                                       "llama-3-8b (it has 32: 0..31)"),
    (["--kv-layer-dtypes", "0:fp9"], "kvbench capacity: error: --kv-layer-dtypes: 'fp9' is not a KV format"),
    (["--kv-dtype", "fp9", "--kv-dtype-skip-layers", "0"], "kvbench capacity: error: --kv-dtype: unknown KV format 'fp9'"),
    (["--model-shape", "deepseek-v3", "--kv-cache-dtype-skip-layers", "0"], "kvbench capacity: error: deepseek-v3 is an MLA"),
])
def test_capacity_errors(argv, message):
    assert one_line_error("capacity", *argv).startswith(message)


def test_capacity_json_and_table_show_the_mixed_row():
    r = CliRunner().invoke(app, ["capacity", "--kv-cache-dtype-skip-layers", "0 1 31", "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert [x["bytes_per_token"] for x in rows if x["name"] == "fp8_e4m3 skip 0,1,31"] == [71680.0]
    r = CliRunner().invoke(app, ["capacity", "--kv-dtype-skip-layers", "0,1,31"])
    assert r.exit_code == 0 and "fp8_e4m3 skip 0,1,31" in r.stdout and "71,680" in r.stdout


# ------------------------------------------------------------------------------ records and reports


def test_capacity_record_keeps_the_layer_set():
    from kvbench.harness.targets import _capacity_dict
    from kvbench.runtime.engine_api import CapacityReport

    rep = CapacityReport("fp8_e4m3", 16, 10, 160, 1536.0, 245760, 64, 2,
                         extra={"kv_dtype_skip_layers": "0,3", "kv_layer_dtypes": None, "layer_formats": {"fp8_e4m3": 2, "bf16": 2},
                                "kv_budget_bytes": 1})
    d = _capacity_dict(rep)
    assert d["kv_dtype_skip_layers"] == "0,3" and d["layer_formats"] == {"fp8_e4m3": 2, "bf16": 2}
    assert "kv_layer_dtypes" not in d and "kv_budget_bytes" not in d and "extra" not in d


def test_reports_show_the_skip_set():
    from kvbench.reports.load import CellData, assign_short_labels, kv_text
    from kvbench.reports.tables import capacity_table, cells_table

    base = {"model": "m", "target": "e", "prefill_backend": "torch", "decode_backend": "torch", "kv_scales": "unit",
            "concurrency": 1}
    uni = CellData("k1", "", {**base, "kv_dtype": "fp8_e4m3"}, "done", capacity={"kv_dtype": "fp8_e4m3", "tokens": 10})
    skip = CellData("k2", "", {**base, "kv_dtype": "fp8_e4m3", "options": {"kv_dtype_skip_layers": "0,1,31"}}, "done",
                    capacity={"kv_dtype": "fp8_e4m3", "tokens": 9, "bytes_per_token": 71680.0, "kv_dtype_skip_layers": "0,1,31"})
    bf16 = CellData("k0", "", {**base, "kv_dtype": "bf16"}, "done")
    assign_short_labels([bf16, uni, skip])
    assert (bf16.short, uni.short, skip.short) == ("bf16", "fp8_e4m3", "fp8_e4m3 skip 0,1,31")
    assign_short_labels([uni, skip])  # only the skip set varies: the label still names the format
    assert (uni.short, skip.short) == ("fp8_e4m3", "fp8_e4m3 skip 0,1,31")
    assert kv_text(skip.config) == kv_text({}, skip.capacity) == "fp8_e4m3 skip 0,1,31" and kv_text(uni.config) == "fp8_e4m3"
    t = capacity_table(SimpleNamespace(capacity=[(uni, uni.capacity, None), (skip, skip.capacity, 0.9)]))
    assert [r[1] for r in t.rows] == ["fp8_e4m3", "fp8_e4m3 skip 0,1,31"] and t.rows[1][2] == "71,680"
    assert cells_table(SimpleNamespace(cells=[skip])).rows[0][5] == "fp8_e4m3 skip 0,1,31"
