"""The matrix side of external engines: explicit backend/KV combinations, accuracy cells off the load axis
(accuracy-only cells, skipped load tests, the resume check), and cell keys / manifests of existing configs
staying what they were."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest

from kvbench.harness.matrix import expand, groups
from kvbench.harness.runner import run_sweep
from kvbench.core.store import RunStore
from kvbench.harness.sweep.config import SweepConfigError, load_config, parse_config
from kvbench.harness.targets import TargetSession

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

# expand() keys before external-engine options existed: they must not change
# (configs/default.yaml has since dropped fp8_e5m2: its three cells are gone, every other cell kept its key)
DEFAULT_KEYS = ['582f8b7e9b90', '993c335e9832', 'baecc42ec6b1', '384b510f96f0', 'd46fa23b8452', 'c1eccf1f0e05',
                '11c67d6701f8', 'cd3030714475', '0d61b7c4495f', '79e7c859ec02']
VLLM_KEYS = ['f1a22ecb32cd', '935029209b45', '9662acdaf55c', '002bc303c56a', '83c862ce0aaf', '0e9225d6555b',
             '71e00aff3480', '95abcd121b22', '5f55ab2429ab', '89e026865083']
ENDPOINT_KEYS = ['d5bfb6021be6', '54ed417ff9cd', 'b0c491852be5', 'e266307779f7']


@pytest.mark.parametrize("name,keys", [("default", DEFAULT_KEYS), ("vllm", VLLM_KEYS), ("endpoint", ENDPOINT_KEYS)])
def test_cell_keys_of_existing_configs_are_unchanged(name, keys):
    assert [c.key for c in expand(load_config(CONFIGS / f"{name}.yaml"))] == keys


def test_the_manifest_form_of_a_config_keeps_its_old_keys():
    """Keys added to targets / KV entries / backends are left out of to_dict at their defaults, so a run
    recorded before them still compares equal on --resume."""
    d = parse_config({"targets": [{"name": "s", "type": "server", "launch": "serve {port} --kv {kv_dtype}"}],
                      "axes": {"backends": ["default"], "kv": ["bf16", {"dtype": "fp8_e4m3", "scales": "unit"}]}}).to_dict()
    assert set(d["targets"][0]) == {"name", "type", "engine", "launch", "host", "port", "health_path", "health_timeout_s",
                                    "base_url", "model_id", "api_key", "env", "flush_cache", "kv_dtype_map", "backend_map"}
    assert d["kv"] == [{"dtype": "bf16", "scales": "unit", "options": {}}, {"dtype": "fp8_e4m3", "scales": "unit", "options": {}}]
    assert d["backends"] == [["default", "default"]] and "combos" not in d and "implicit_axes" not in d
    d = parse_config({"targets": [{"name": "s", "type": "server", "launch": "serve {port} --kv {kv_dtype} {attention_backend}",
                                   "tp_size": 4, "engine_kind": "generic", "backends": [{"backend": "a", "extra_args": "--x"}]}],
                      "axes": {"kv": [{"dtype": "bf16", "extra_args": "--y"}]}}).to_dict()
    t = d["targets"][0]
    assert (t["tp_size"], t["backends"], "engine_kind" in t) == (4, [["a", "a", "--x"]], False)  # generic is sniffed
    assert d["kv"][0]["extra_args"] == "--y"


# ------------------------------------------------------------------------------ combos
SRV = {"name": "srv", "type": "server",
       "launch": "serve --port {port} --kv {kv_dtype} --p {prefill_backend} --d {decode_backend}"}


def combos_cfg(combos, **over):
    raw = {"targets": [SRV], "axes": {"combos": combos, "concurrency": [8, 16]}, **over}
    return parse_config(raw)


def test_combos_run_exactly_the_listed_pairs():
    cfg = combos_cfg([{"backends": "triton", "kv": "bf16"}, {"backends": "trtllm_mha", "kv": "bf16"},
                      {"backends": "triton+trtllm_mha", "kv": {"dtype": "fp8_e4m3"}}])
    cells = expand(cfg)
    assert [(c.config["prefill_backend"], c.config["decode_backend"], c.config["kv_dtype"], c.concurrency) for c in cells] == [
        ("triton", "triton", "bf16", 8), ("triton", "triton", "bf16", 16),
        ("trtllm_mha", "trtllm_mha", "bf16", 8), ("trtllm_mha", "trtllm_mha", "bf16", 16),
        ("triton", "trtllm_mha", "fp8_e4m3", 8), ("triton", "trtllm_mha", "fp8_e4m3", 16)]
    assert len(groups(cells)) == 3 and len({c.key for c in cells}) == 6
    # a combination is the same cell as the product would make (same key)
    prod = parse_config({"targets": [SRV], "axes": {"backends": ["triton"], "kv": ["bf16"], "concurrency": [8]}})
    assert expand(prod)[0].key == cells[0].key
    assert cfg.to_dict()["combos"][2] == {"backends": ["triton", "trtllm_mha"],
                                          "kv": {"dtype": "fp8_e4m3", "scales": "unit", "options": {}}}
    assert [list(b) for b in cfg.backends] == [["triton", "triton"], ["trtllm_mha", "trtllm_mha"], ["triton", "trtllm_mha"]]


@pytest.mark.parametrize("combos,over,needle", [
    ([{"backends": "triton", "kv": "bf16"}, {"backends": "triton", "kv": "bf16"}], {}, "axes.combos: duplicate entries"),
    ([{"backends": "triton"}], {}, "axes.combos[0].kv: missing"),
    ([{"backends": "triton", "kv": "fp9"}], {}, "axes.combos[0].kv.dtype: 'fp9'"),
    ([{"backends": "triton", "kv": "bf16", "target": "x"}], {}, "axes.combos[0]: unknown key 'target'"),
    ([], {}, "axes.combos: expected a non-empty list"),
])
def test_combos_are_validated_like_the_axes(combos, over, needle):
    with pytest.raises(SweepConfigError) as e:
        combos_cfg(combos, **over)
    assert needle in str(e.value)


def test_combos_exclude_the_product_axes_and_target_backends():
    with pytest.raises(SweepConfigError, match=r"axes.kv: axes.combos lists"):
        parse_config({"targets": [SRV], "axes": {"combos": [{"backends": "a", "kv": "bf16"}], "kv": ["bf16"]}})
    with pytest.raises(SweepConfigError, match=r"targets\[0\].backends: a target's own backends cannot"):
        parse_config({"targets": [{**SRV, "backends": ["a"]}], "axes": {"combos": [{"backends": "a", "kv": "bf16"}]}})
    with pytest.raises(SweepConfigError, match=r"axes.combos\[0\].backends: 'trtllm_mha' is not a backend of the embedded"):
        parse_config({"axes": {"combos": [{"backends": "trtllm_mha", "kv": "bf16"}]}})


# ------------------------------------------------------------------------------ accuracy off the load axis
def acc_cfg(conc=(768,), acc=1000, **over):
    raw = {"targets": [SRV], "axes": {"backends": ["triton", "a+b"], "kv": ["bf16"], "concurrency": list(conc)},
           "accuracy_concurrency": acc, "suites": [{"name": "gsm8k_chat", "limit": 1}], "load": {"num_prompts": 1},
           "baseline": {"prefill_backend": "triton"}, **over}
    return parse_config(raw)


def test_accuracy_concurrency_off_the_load_axis_adds_an_accuracy_only_cell_per_group():
    cells = expand(acc_cfg())
    got = [(c.config["prefill_backend"], c.concurrency, c.run_accuracy, c.run_load, bool(c.config.get("aa_control")))
           for c in cells]
    assert got == [("triton", 1000, True, False, False), ("triton", 768, False, True, False),
                   ("a", 1000, True, False, False), ("a", 768, False, True, False),
                   ("triton", 500, True, False, True)]  # the A/A control: half the accuracy concurrency
    assert [len(g) for g in groups(cells)] == [2, 2, 1]
    # on the axis: as before, one cell per level, the suites in the one at accuracy_concurrency
    on = expand(acc_cfg(conc=(768, 1000)))
    assert [(c.concurrency, c.run_accuracy, c.run_load) for c in on[:2]] == [(768, False, True), (1000, True, True)]
    assert on[1].key == cells[0].key  # the same cell config: the same key
    with pytest.raises(SweepConfigError, match="this sweep has no suites"):
        acc_cfg(suites=[])


class Recorder:
    def __init__(self):
        self.calls = []

    @contextmanager
    def opener(self, spec, cell_config, engine_kwargs, log_path, **extra):
        yield TargetSession(object(), "m", url="http://fake", capacity=lambda: {"tokens": 1})

    def suite(self, spec, client, cell, fidelity):
        self.calls.append(("suite", cell.concurrency))
        return [{"suite": spec.name, "item_id": "0", "repeat": 0, "correct": True}], {"accuracy": 1.0}

    def load(self, base_url, model_id, cell):
        self.calls.append(("load", cell.concurrency))
        return {"output_throughput": 1.0}, [{"request_id": "r", "success": True}]


def test_accuracy_only_cells_skip_the_load_test_and_resume_checks_it(tmp_path):
    cfg = acc_cfg(axes={"backends": ["triton"], "kv": ["bf16"], "concurrency": [768]}, aa_control=False)
    r = Recorder()
    out = run_sweep(cfg, tmp_path / "run", work=r, opener=r.opener, progress=False)
    assert out.ok and r.calls == [("suite", 1000), ("load", 768)]
    store = RunStore(tmp_path / "run")
    cells = expand(cfg)
    assert store.read_json(cells[0].key, "summary")["load"] is None
    assert store.read_json(cells[1].key, "summary")["load"] == {"output_throughput": 1.0}
    assert [(c["run_accuracy"], c["run_load"]) for c in store.manifest()["cells"]] == [(True, False), (False, True)]
    # 1000 joins the load axis: the finished accuracy-only cell (same key) would now need a load test
    grown = acc_cfg(axes={"backends": ["triton"], "kv": ["bf16"], "concurrency": [768, 1000]}, aa_control=False)
    with pytest.raises(SweepConfigError, match="run the accuracy suites or the load test"):
        run_sweep(grown, tmp_path / "run", resume=True, work=r, opener=r.opener, progress=False)
