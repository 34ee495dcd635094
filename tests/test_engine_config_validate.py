"""EngineConfig.validate checks types and devices (values come from YAML and the command line), and a bad
--device is one usage error (exit 2), not a traceback from torch.device."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvbench.runtime.config import ConfigError, EngineConfig

KVBENCH = str(Path(sys.executable).parent / "kvbench")


@pytest.mark.parametrize("field,value,needle", [
    ("kv_budget_gb", "abc", "kv_budget_gb must be a positive number"),
    ("kv_budget_gb", 0, "kv_budget_gb must be a positive number"),
    ("kv_budget_gb", float("nan"), "kv_budget_gb"),
    ("page_size", -4, "page_size must be a positive integer"),
    ("page_size", "16", "page_size must be a positive integer"),
    ("page_size", 12, "power of two"),
    ("mem_fraction", "0.5", "mem_fraction"),
    ("max_running", 2.5, "max_running must be a positive integer"),
    ("max_num_batched_tokens", True, "max_num_batched_tokens"),
    ("max_model_len", 0, "max_model_len"),
    ("calibration_prompts", 0, "calibration_prompts"),
    ("seed", "1", "seed must be an integer"),
    ("enforce_eager", "yes", "enforce_eager must be true or false"),
    ("fused_append", 1, "fused_append"),
    ("device", "quantum", "choose cpu, cuda or cuda:N"),
    ("device", "mps", "choose cpu, cuda or cuda:N"),
    ("device", "cuda:", "device"),
    ("device", 0, "device"),
    ("model", "", "model must be a non-empty string"),
    ("extra", [], "extra must be a mapping"),
])
def test_bad_values_are_config_errors_naming_the_field(field, value, needle):
    with pytest.raises(ConfigError, match=needle) as e:
        EngineConfig(**{field: value})
    assert e.value.field == field


@pytest.mark.parametrize("device", [None, "cpu", "cuda", "cuda:0", "cuda:12"])
def test_supported_devices_validate(device):
    assert EngineConfig(device=device, kv_budget_gb=1, mem_fraction=1).device == device  # ints are numbers too


def test_device_helper_turns_torch_errors_into_value_errors():
    from kvbench.runtime.models.engine_setup import engine_device as _device

    for bad in ("quantum", "cuda:x"):  # EngineConfig rejects these; _device must not traceback either
        with pytest.raises(ValueError, match="not a device"):
            _device(SimpleNamespace(device=bad))
    with pytest.raises(ValueError, match="not supported"):
        _device(SimpleNamespace(device="meta"))
    assert _device(SimpleNamespace(device="cpu")).type == "cpu"


@pytest.mark.parametrize("argv", [
    ["eval", "--suite", "gsm8k", "--limit", "1", "--device", "quantum", "--out", "o"],
    ["serve", "--device", "quantum", "--port", "1"],
])
def test_bad_device_flag_is_a_usage_error(tmp_path, argv):
    out = subprocess.run([KVBENCH, *argv], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert "--device" in out.stderr and "quantum" in out.stderr
