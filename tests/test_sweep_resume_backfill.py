"""A run made before a schema addition resumes: keys a newer kvbench added to suites, targets and the load
section (absent from the old manifest) read as their defaults, not as a changed config; a real change
of an old key is still refused."""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest

from kvbench.harness.runner import run_sweep
from kvbench.harness.sweep.config import SweepConfigError, parse_config
from kvbench.harness.targets import TargetSession

RAW = {
    "name": "old",
    "axes": {"kv": ["bf16", "fp8_e4m3"], "concurrency": [1]},
    "suites": [{"name": "gsm8k_chat", "limit": 2}],
    "load": {"num_prompts": 2},
    "aa_control": False,
}


class _Client:
    model_id = "fake"

    def close(self):
        pass


@contextmanager
def _opener(spec, cfg, engine_kwargs, log_path, **kw):
    yield TargetSession(_Client(), "fake", url="http://fake")


class _Work:
    def __init__(self):
        self.ran = []

    def suite(self, spec, client, cell, fidelity):
        self.ran.append(cell.key)
        return [{"suite": spec.name, "item_id": "0", "repeat": 0, "correct": True}], {"accuracy": 1.0, "n": 1}

    def load(self, base_url, model_id, cell):
        return {"completed": 2}, [{"request_id": "r0", "success": True}]


def _age_manifest(run, drop_suite=("request",), drop_target=("request", "timeout_s", "max_retries"),
                  drop_load=("metrics_interval_s",)):
    """Make the manifest look written by an older kvbench: remove newer keys."""
    path = run / "manifest.json"
    m = json.loads(path.read_text())
    for s in m["config"]["suites"]:
        for k in drop_suite:
            s.pop(k, None)
    for t in m["config"]["targets"]:
        for k in drop_target:
            t.pop(k, None)
    for k in drop_load:
        m["config"]["load"].pop(k, None)
    path.write_text(json.dumps(m))


def test_resume_of_a_run_made_before_new_keys(tmp_path):
    run = tmp_path / "run"
    first = _Work()
    run_sweep(parse_config(RAW), run, work=first, opener=_opener, progress=False, only="kv_dtype=bf16")
    assert len(first.ran) == 1
    _age_manifest(run)
    again = _Work()
    outcome = run_sweep(parse_config(RAW), run, resume=True, work=again, opener=_opener, progress=False)
    assert len(outcome.skipped) == 1 and len(outcome.done) == 1
    assert again.ran and first.ran[0] not in again.ran


def test_a_real_change_of_an_old_key_is_still_refused(tmp_path):
    run = tmp_path / "run"
    run_sweep(parse_config(RAW), run, work=_Work(), opener=_opener, progress=False, only="kv_dtype=bf16")
    _age_manifest(run)
    changed = {**RAW, "suites": [{"name": "gsm8k_chat", "limit": 3}]}
    with pytest.raises(SweepConfigError, match=r"suites\[0\]\.limit"):
        run_sweep(parse_config(changed), run, resume=True, work=_Work(), opener=_opener, progress=False)


def test_a_new_key_set_to_a_value_is_a_change(tmp_path):
    """The old run was made without request options; asking for them now cannot reuse its cells."""
    run = tmp_path / "run"
    run_sweep(parse_config(RAW), run, work=_Work(), opener=_opener, progress=False, only="kv_dtype=bf16")
    _age_manifest(run)
    changed = {**RAW, "suites": [{"name": "gsm8k_chat", "limit": 2, "request": {"top_p": 0.9}}]}
    with pytest.raises(SweepConfigError, match=r"suites\[0\]\.request"):
        run_sweep(parse_config(changed), run, resume=True, work=_Work(), opener=_opener, progress=False)
