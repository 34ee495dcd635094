"""Every cell option reaches a server's launch command or the config is refused (harness/launch/options.py,
harness/sweep/axes.py): placeholders, option_flags, extra arguments, engine backend names, refusals with the
key path and what to add, and --dry-run / a real sweep refusing the same configs."""

from __future__ import annotations

import copy

import pytest
from typer.testing import CliRunner

from kvbench.harness.cli import app
from kvbench.harness.launch.options import sniff_engine_kind
from kvbench.harness.matrix import expand, groups
from kvbench.harness.sweep.config import SweepConfigError, TargetSpec, parse_config
from kvbench.harness.targets import TargetError, render_launch

SGL = ("python -m sglang.launch_server --model-path {model} --port {port} --tp-size {tp_size} "
       "--kv-cache-dtype {kv_dtype} --prefill-attention-backend {prefill_backend} "
       "--decode-attention-backend {decode_backend}")


def server(launch=SGL, **kw) -> dict:
    return {"name": "srv", "type": "server", "launch": launch, **kw}


def cfg_of(target: dict, axes: dict, **over):
    return parse_config({"targets": [target], "axes": axes, **over})


def error_of(target: dict, axes: dict, **over) -> str:
    with pytest.raises(SweepConfigError) as e:
        cfg_of(target, axes, **over)
    return str(e.value)


def commands(cfg) -> list[str]:
    """The launch command of each cell group (port 9000)."""
    out = []
    for g in groups(expand(cfg)):
        spec = cfg.target(g[0].config["target"])
        out.append(render_launch(spec, g[0].config, 9000))
    return out


# ------------------------------------------------------------------------------ rendering
def test_engine_backend_names_pass_verbatim_and_hybrid_pairs_render_per_phase():
    cfg = cfg_of(server(tp_size=8), {"backends": ["triton", "trtllm_mha", "triton+trtllm_mha", "FLASHINFER"],
                                     "kv": ["bf16", "fp8_e4m3"]})
    cmds = commands(cfg)
    assert len(cmds) == 8
    assert cmds[0] == ("python -m sglang.launch_server --model-path default --port 9000 --tp-size 8 --kv-cache-dtype "
                       "bf16 --prefill-attention-backend triton --decode-attention-backend triton")
    assert "--kv-cache-dtype fp8_e4m3 --prefill-attention-backend triton --decode-attention-backend trtllm_mha" in cmds[5]
    assert "--prefill-attention-backend FLASHINFER" in cmds[6]


def test_option_flags_render_only_what_the_cell_says():
    launch = "vllm serve m --port {port} --kv-cache-dtype {kv_dtype} --attention-backend {attention_backend} {extra_args} --tail"
    t = server(launch, kv_dtype_map={"bf16": "auto"}, option_flags={
        "kv_scales": {"calibrate": "--calculate-kv-scales", "checkpoint": ""},
        "scales_file": "--quantization-param-path {value}",
        "quantize_query": {"decode": "--fp8-q-decode", True: "--fp8-q"},
    }, extra_args="--max-num-seqs 8")
    kv = ["bf16", {"dtype": "fp8_e4m3", "scales": "calibrate"}, {"dtype": "fp8_e4m3", "scales": "checkpoint"},
          {"dtype": "fp8_e5m2", "scales_file": "/scales/k v.json", "quantize_query": "decode"},
          {"dtype": "fp8_e5m2", "quantize_query": "both", "extra_args": "--enforce-eager"}]
    cfg = cfg_of(t, {"backends": [{"backend": "FLASHINFER", "extra_args": "--block-size 32"}], "kv": kv})
    cmds = commands(cfg)
    head = "vllm serve m --port 9000 --kv-cache-dtype "
    assert cmds[0] == head + "auto --attention-backend FLASHINFER --max-num-seqs 8 --block-size 32 --tail"
    assert cmds[1] == head + "fp8_e4m3 --attention-backend FLASHINFER --calculate-kv-scales --max-num-seqs 8 --block-size 32 --tail"
    assert cmds[2] == head + "fp8_e4m3 --attention-backend FLASHINFER --max-num-seqs 8 --block-size 32 --tail"  # checkpoint: ''
    assert cmds[3] == (head + "fp8_e5m2 --attention-backend FLASHINFER --quantization-param-path '/scales/k v.json' "
                       "--fp8-q-decode --max-num-seqs 8 --block-size 32 --tail")
    # quantize_query both is recorded as true; option_flags key true and both are the same value
    assert cmds[4].endswith("--fp8-q --max-num-seqs 8 --block-size 32 --enforce-eager --tail")
    cells = expand(cfg)
    assert cells[3].config["scales_file"] == "/scales/k v.json" and cells[3].config["kv_scales"] == "checkpoint"
    assert cells[3].config["options"] == {"quantize_query": "decode"} and cells[4].config["options"] == {"quantize_query": True}
    assert cells[0].config["extra_args"] == "--block-size 32"
    assert cells[4].config["extra_args"] == "--block-size 32 --enforce-eager"
    assert cells[3].label == "fp8_e5m2/checkpoint@k v.json+quantize_query=decode FLASHINFER [--block-size 32] c=1"


def test_extra_args_are_appended_without_the_placeholder_and_devices_render():
    t = server("serve --port {port} --kv {kv_dtype} --gpus {devices} --tp {tp_size}", tp_size=2, extra_args="--x 1")
    cfg = cfg_of(t, {"kv": ["fp8_e4m3"]})
    spec, cell = cfg.targets[0], expand(cfg)[0].config
    assert render_launch(spec, cell, 7) == "serve --port 7 --kv fp8_e4m3 --gpus 0,1 --tp 2 --x 1"
    assert render_launch(spec, cell, 7, devices=[5, 3]) == "serve --port 7 --kv fp8_e4m3 --gpus 5,3 --tp 2 --x 1"
    spec.devices = [6, 7]
    assert "--gpus 6,7" in render_launch(spec, cell, 7)


def test_a_server_without_axes_runs_the_engine_defaults_and_passes_nothing():
    cfg = parse_config({"targets": [server("serve --port {port}")]})
    (cell,) = expand(cfg)
    assert (cell.config["kv_dtype"], cell.config["prefill_backend"], cell.config["decode_backend"]) == ("auto", "default", "default")
    assert cell.label == "auto/unit default c=1"
    assert commands(cfg) == ["serve --port 9000"]
    # the same config with an embedded target keeps the embedded defaults (cell keys unchanged)
    (emb,) = expand(parse_config({}))
    assert (emb.config["kv_dtype"], emb.config["prefill_backend"]) == ("bf16", "torch")


def test_a_target_s_own_backends_replace_the_axis():
    raw = {"engine": {"device": "cpu"},
           "targets": [{"name": "emb", "type": "embedded"},
                       server(backends=["triton", {"prefill": "triton", "decode": "trtllm_mha"}])],
           "axes": {"backends": ["torch"], "kv": ["bf16"]}}
    cells = expand(parse_config(raw))
    assert [(c.config["target"], c.config["prefill_backend"], c.config["decode_backend"]) for c in cells] == [
        ("emb", "torch", "torch"), ("srv", "triton", "triton"), ("srv", "triton", "trtllm_mha")]
    bad = copy.deepcopy(raw)
    bad["targets"][0]["backends"] = ["torch", "trtllm_mha"]
    with pytest.raises(SweepConfigError, match=r"targets\[0\].backends\[1\]: 'trtllm_mha' is not a backend of the embedded engine"):
        parse_config(bad)


@pytest.mark.parametrize("launch,kind", [
    ("python -m sglang.launch_server --port {port}", "sglang"), ("vllm serve m --port {port}", "vllm"),
    ("{python} -m kvbench.harness serve --port {port}", "kvbench"), ("kvbench serve --port {port}", "kvbench"),
    ("python tests/fake_engines/fake_sglang.py --port {port}", "sglang"), ("./my-server --port {port}", "generic"),
])
def test_engine_kind_is_sniffed_from_the_launch(launch, kind):
    assert sniff_engine_kind(launch, "server") == kind
    assert cfg_of(server(launch), {}).targets[0].engine_kind == kind
    assert cfg_of(server(launch, engine_kind="generic"), {}).targets[0].engine_kind == "generic"


def test_endpoint_and_embedded_kinds_and_render_errors():
    assert sniff_engine_kind(None, "endpoint") == "generic" and sniff_engine_kind(None, "embedded") == "kvbench"
    spec = TargetSpec(name="s", type="server", launch="serve {port} --b {attention_backend}")
    cell = {"model": "m", "target": "s", "prefill_backend": "triton", "decode_backend": "trtllm_mha",
            "kv_dtype": "bf16", "kv_scales": "unit", "concurrency": 1}
    with pytest.raises(TargetError, match="prefill and decode backends differ"):
        render_launch(spec, cell, 1)


# ------------------------------------------------------------------------------ refusals
VLLM = "vllm serve m --port {port} --kv-cache-dtype {kv_dtype} --attention-backend {attention_backend}"


@pytest.mark.parametrize("target,axes,needles", [
    # the backend pair is not in the template at all
    (server("python -m sglang.launch_server --port {port} --kv-cache-dtype {kv_dtype}"), {"backends": ["triton"]},
     ["axes.backends[0]: prefill_backend 'triton' does not reach target 'srv' (targets[0])", "{prefill_backend}",
      "--prefill-attention-backend {prefill_backend}", "'default'"]),
    # one backend for both phases, a hybrid entry
    (server(VLLM), {"backends": ["FLASHINFER", "triton+trtllm_mha"]},
     ["axes.backends[1]: prefill 'triton' and decode 'trtllm_mha' differ", "{attention_backend}",
      "{prefill_backend} and {decode_backend}"]),
    # a kv dtype the template cannot carry
    (server("vllm serve m --port {port}"), {"kv": ["bf16", "fp8_e4m3"]},
     ["axes.kv[0].dtype: kv_dtype 'bf16' does not reach", "--kv-cache-dtype {kv_dtype}", "'auto'"]),
    # calibrated scales without the flag
    (server(VLLM), {"backends": ["FLASHINFER"], "kv": [{"dtype": "fp8_e4m3", "scales": "calibrate"}]},
     ["axes.kv[0].scales: kv_scales 'calibrate' does not reach", "{calibrate: \"--calculate-kv-scales\"}"]),
    # checkpoint scales: the server loads them without a flag only if the config says so
    (server(VLLM), {"backends": ["FLASHINFER"], "kv": [{"dtype": "fp8_e4m3", "scales": "checkpoint"}]},
     ["axes.kv[0].scales", "{kv_scales: {checkpoint: ''}}"]),
    # a scales file
    (server(SGL), {"backends": ["triton"], "kv": [{"dtype": "fp8_e4m3", "scales_file": "/s.json"}]},
     ["axes.kv[0].scales_file: scales_file '/s.json' does not reach", "--quantization-param-path {value}"]),
    # query quantization (a runtime option of the embedded engine)
    (server(SGL), {"backends": ["triton"], "kv": [{"dtype": "fp8_e4m3", "quantize_query": "prefill"}]},
     ["axes.kv[0].quantize_query: quantize_query 'prefill' does not reach", "{quantize_query}"]),
    (server(SGL), {"backends": ["triton"], "kv": [{"dtype": "fp8_e4m3", "kv_scales_per_head": True}]},
     ["axes.kv[0].kv_scales_per_head", "option_flags"]),
    # a value-keyed mapping without the cell's value
    (server(VLLM, option_flags={"kv_scales": {"calibrate": "--calculate-kv-scales"}}),
     {"backends": ["FLASHINFER"], "kv": [{"dtype": "fp8_e4m3", "scales": "checkpoint"}]},
     ["axes.kv[0].scales: kv_scales 'checkpoint' is not in targets[0].option_flags.kv_scales", "'calibrate'",
      "add checkpoint:"]),
    # {scales_file} in the template, an entry without a file
    (server(SGL + " --quantization-param-path {scales_file}"), {"backends": ["triton"], "kv": ["bf16"]},
     ["axes.kv[0].scales_file", "passes {scales_file}", "option_flags"]),
    # combos are checked like the axes
    (server(VLLM), {"combos": [{"backends": "FLASHINFER", "kv": "bf16"}, {"backends": "a+b", "kv": "bf16"}]},
     ["axes.combos[1].backends: prefill 'a' and decode 'b' differ"]),
])
def test_an_option_the_launch_cannot_carry_is_refused(target, axes, needles):
    msg = error_of(target, axes)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"


@pytest.mark.parametrize("raw,needles", [
    ({"targets": [{"name": "e", "type": "embedded"}], "axes": {"backends": ["torch", "fa3"]}},
     ["axes.backends[1]: 'fa3' is not a backend of the embedded engine", "torch, triton, flashinfer"]),
    ({"targets": [{"name": "e", "type": "embedded"}], "axes": {"kv": ["auto"]}}, ["axes.kv[0].dtype: 'auto'"]),
    ({"targets": [{"name": "e", "type": "embedded"}], "axes": {"backends": [{"backend": "torch", "extra_args": "--x"}]}},
     ["axes.backends[0].extra_args", "launches no server"]),
    ({"targets": [{"name": "e", "type": "embedded"}], "axes": {"kv": [{"dtype": "fp8_e4m3", "scales_file": "/s"}]}},
     ["axes.kv[0].scales_file", "takes no scales file"]),
    ({"targets": [{"name": "p", "type": "endpoint", "base_url": "http://h:1"}], "axes": {"kv": [{"dtype": "bf16", "extra_args": "--x"}]}},
     ["axes.kv[0].extra_args", "nothing is launched"]),
    ({"targets": [{"name": "e", "type": "embedded", "option_flags": {"kv_scales": "--s {value}"}}]},
     ["targets[0].option_flags: applies to server targets only"]),
    ({"targets": [{"name": "e", "type": "endpoint", "base_url": "http://h:1", "tp_size": 2}]}, ["targets[0].tp_size"]),
    ({"targets": [server("serve {port} {gpu}")]}, ["targets[0].launch: unknown placeholder {gpu}", "{attention_backend}"]),
    ({"targets": [server("serve {port} {")]}, ["targets[0].launch: not a valid template"]),
    ({"targets": [server("serve {port}", engine_kind="tgi")]}, ["targets[0].engine_kind", "sglang, vllm, kvbench, generic"]),
    ({"targets": [server("serve {port}", option_flags={"kv_scale": "--s"})]}, ["targets[0].option_flags", "'kv_scale'"]),
    ({"targets": [server("serve {port}", option_flags={"kv_scales": "--s {scale}"})]}, ["option_flags.kv_scales", "{value}"]),
    ({"targets": [server("serve {port}", option_flags={"kv_scales": {"calibrated": "--c"}})]},
     ["option_flags.kv_scales.calibrated", "unit, checkpoint, calibrate"]),
    ({"targets": [server("serve {port}", extra_args="--a 'unclosed")]}, ["targets[0].extra_args", "not valid shell text"]),
    ({"targets": [server("serve {port}", devices=[0, 0])]}, ["targets[0].devices", "twice"]),
    ({"axes": {"backends": ["tri ton"]}}, ["axes.backends[0]", "not a backend name"]),
    ({"axes": {"kv": [{"dtype": "fp8_e4m3", "quantize_query": "sometimes"}]}}, ["axes.kv[0].quantize_query", "prefill, decode"]),
    ({"axes": {"kv": [{"dtype": "fp8_e4m3", "scales": "calibrate", "scales_file": "/s"}]}}, ["axes.kv[0].scales", "scales: checkpoint"]),
])
def test_config_errors_name_the_key(raw, needles):
    with pytest.raises(SweepConfigError) as e:
        parse_config({"engine": {"device": "cpu"}, **raw})
    for needle in needles:
        assert needle in str(e.value), f"{needle!r} not in {e.value}"


@pytest.mark.parametrize("value,recorded", [(False, False), (True, True), ("both", True), ("none", False),
                                            ("prefill", "prefill"), ("Decode", "decode")])
def test_quantize_query_modes_are_accepted_for_embedded_targets(value, recorded):
    cfg = parse_config({"engine": {"device": "cpu"}, "axes": {"kv": [{"dtype": "fp8_e4m3", "quantize_query": value}]}})
    (cell,) = [c for c in expand(cfg)]
    assert cell.config["options"] == {"quantize_query": recorded}
    from kvbench.harness.matrix import engine_options
    from kvbench.runtime.config import EngineConfig

    assert EngineConfig(**engine_options(cfg, cell)).quantize_query == {True: "both", False: "none"}.get(recorded, recorded)


# ------------------------------------------------------------------------------ the command line
def test_dry_run_and_a_real_sweep_refuse_a_lying_label(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("targets:\n  - {name: s, type: server, launch: 'serve --port {port}'}\n"
                   "axes: {kv: [fp8_e4m3], concurrency: [1]}\n")
    for extra in (["--dry-run"], []):
        r = CliRunner().invoke(app, ["sweep", str(bad), "--out", str(tmp_path / "run"), *extra])
        assert r.exit_code == 2 and "axes.kv[0].dtype: kv_dtype 'fp8_e4m3' does not reach target 's'" in r.output, r.output
        assert not (tmp_path / "run").exists()


def test_dry_run_shows_each_group_s_launch_command(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("targets:\n  - {name: s, type: server, launch: 'serve --port {port} --kv {kv_dtype}', env: {A: '1'}}\n"
                 "  - {name: f, type: server, port: 8123, launch: 'serve --port {port} --kv {kv_dtype}'}\n"
                 "axes: {kv: [bf16, fp8_e4m3], concurrency: [1, 2]}\n")
    r = CliRunner().invoke(app, ["sweep", str(p), "--dry-run", "--out", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert lines[-1] == f"8 cells -> {tmp_path / 'run'}"
    cmds = [line.strip() for line in lines if line.strip().startswith("$ ")]
    assert cmds == ["$ serve --port <port> --kv bf16", "$ serve --port <port> --kv fp8_e4m3",
                    "$ serve --port 8123 --kv bf16", "$ serve --port 8123 --kv fp8_e4m3"]
    assert lines.count("  env A=1") == 2 and "launch for s bf16/unit default c=1 (2 cells, target s):" in lines
