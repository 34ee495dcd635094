"""KV scale policies: unit (warns for quantized formats), checkpoint, calibrate."""

import warnings

import pytest
import torch

from kvbench.runtime.scales import AmaxObserver, UnitScaleWarning, checkpoint_scales, unit_scales


def test_unit_warns_only_for_quantized_formats():
    with pytest.warns(UnitScaleWarning, match="calibrate"):
        s = unit_scales("fp8_e4m3", 3)
    assert s.k.tolist() == [1.0, 1.0, 1.0] and s.source == "unit"
    with pytest.warns(UnitScaleWarning):
        unit_scales("nvfp4", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        unit_scales("bf16", 2)


def test_calibrate_per_layer_and_per_head():
    obs = AmaxObserver(num_layers=2, num_kv_heads=2)
    k = torch.zeros(5, 2, 8)
    k[0, 0, 0], k[1, 1, 3] = -896.0, 448.0
    v = torch.ones(5, 2, 8)
    obs.observe(0, k, v)
    obs.observe(1, k / 2, v * 3)
    s = obs.scales("fp8_e4m3")
    assert s.k.tolist() == [2.0, 1.0] and s.v.tolist() == pytest.approx([1 / 448, 3 / 448])
    ph = obs.scales("fp8_e4m3", per_head=True)
    assert ph.k.tolist() == [[2.0, 1.0], [1.0, 0.5]] and ph.per_head
    fp4 = obs.scales("nvfp4")
    assert fp4.k.tolist() == pytest.approx([896 / (6 * 448), 448 / (6 * 448)])
    assert obs.tokens == 5


def test_calibrate_without_data_fails():
    with pytest.raises(RuntimeError, match="no tokens"):
        AmaxObserver(1, 1).scales("fp8_e4m3")


def test_checkpoint_scales():
    s = checkpoint_scales({0: (torch.tensor(0.5), torch.tensor(0.25)), 1: (torch.tensor(2.0), torch.tensor(1.0))}, 2)
    assert s.k.tolist() == [0.5, 2.0] and s.v.tolist() == [0.25, 1.0] and not s.per_head
    with pytest.raises(ValueError, match="layers \\[1\\]"):
        checkpoint_scales({0: (torch.tensor(1.0), torch.tensor(1.0))}, 2)
    with pytest.raises(ValueError, match="finite and positive"):
        checkpoint_scales({0: (torch.tensor(-1.0), torch.tensor(1.0))}, 1)
