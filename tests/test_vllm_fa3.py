"""tools/vllm_fa3.py on the CPU: where the FA3 library is looked for (without importing vllm), the schema check,
and the arguments ``PagedFA3`` hands the operator (a stand-in records them).  The operator itself runs in
tests/test_gpu_vllm_fa3.py against the float64 reference."""

from __future__ import annotations

import sys

import pytest
import torch

from kvbench.tools import vllm_fa3
from kvbench.tools.kernel_check import as_layout


@pytest.fixture
def no_vllm(monkeypatch, tmp_path):
    monkeypatch.delenv(vllm_fa3.ENV, raising=False)
    monkeypatch.setattr(vllm_fa3.importlib.util, "find_spec", lambda name: None)
    return tmp_path


def test_find_library_from_env_and_its_errors(no_vllm, monkeypatch):
    path, why = vllm_fa3.find_library()
    assert path is None and vllm_fa3.ENV in why
    monkeypatch.setenv(vllm_fa3.ENV, str(no_vllm / "missing.so"))
    path, why = vllm_fa3.find_library()
    assert path is None and "is not a file" in why
    so = no_vllm / "fa3.so"
    so.write_bytes(b"\x7fELF")
    monkeypatch.setenv(vllm_fa3.ENV, str(so))
    assert vllm_fa3.find_library() == (so, "")
    assert not vllm_fa3.available() or torch.cuda.is_available()  # no GPU here: never available


def test_find_library_in_a_vllm_package_without_importing_it(monkeypatch, tmp_path):
    monkeypatch.delenv(vllm_fa3.ENV, raising=False)
    pkg = tmp_path / "vllm"
    (pkg / "vllm_flash_attn").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    path, why = vllm_fa3.find_library()
    assert path is None and "has no" in why
    so = pkg / "vllm_flash_attn" / "_vllm_fa3_C.abi3.so"
    so.write_bytes(b"\x7fELF")
    assert vllm_fa3.find_library() == (so, "")
    assert "vllm" not in sys.modules
    with pytest.raises(RuntimeError, match="not available"):
        monkeypatch.setenv(vllm_fa3.ENV, str(tmp_path / "none.so"))
        monkeypatch.setattr(vllm_fa3, "_LOADED", {})
        vllm_fa3.load()


def test_schema_check_names_what_is_missing():
    assert vllm_fa3.check_schema(set(vllm_fa3.NEEDED) | {"extra"}, "x.so") == set(vllm_fa3.NEEDED) | {"extra"}
    with pytest.raises(RuntimeError, match=r"\['page_table', 'seqused_k'\]"):
        vllm_fa3.check_schema(set(vllm_fa3.NEEDED) - {"page_table", "seqused_k"}, "x.so")


class _FakeFwd:
    def __init__(self):
        self.calls = []

    def __call__(self, **kw):
        self.calls.append(kw)
        kw["out"].fill_(1.0)
        return [kw["out"]]


class _FakeOps:
    def __init__(self):
        self.fwd = _FakeFwd()


@pytest.fixture
def fake_fa3(monkeypatch):
    ops = _FakeOps()
    names = set(vllm_fa3.NEEDED) | {"k_new", "v_new", "pack_gqa", "sm_margin", "scheduler_metadata"}
    monkeypatch.setattr(vllm_fa3, "_LOADED", {"ops": ops, "names": names, "path": "fake.so"})
    return ops


def _pages(dtype, layout, p=6, page=16, hk=2, d=64):
    x = torch.randn(p, page, hk, d).to(dtype)
    return as_layout(x, layout), x


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_paged_fa3_arguments(fake_fa3, layout):
    kp, dense = _pages(torch.bfloat16, layout)
    vp, _ = _pages(torch.bfloat16, layout)
    q = torch.randn(40, 8, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 30, 40], dtype=torch.int32)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    lens = torch.tensor([40, 20], dtype=torch.int32)
    out = vllm_fa3.PagedFA3(q, kp, vp, cu, 30, table, lens, 40)()
    (kw,) = fake_fa3.fwd.calls
    assert kw["k"].is_contiguous() and kw["k"].shape == (6, 16, 2, 64) and torch.equal(kw["k"], dense)
    assert kw["is_causal"] is True and kw["max_seqlen_q"] == 30 and kw["max_seqlen_k"] == 40
    assert kw["seqused_k"] is lens and kw["page_table"] is table and kw["cu_seqlens_q"] is cu
    assert kw["softmax_scale"] == pytest.approx(64 ** -0.5) and kw["q_descale"] is None
    assert (kw["window_size_left"], kw["window_size_right"], kw["num_splits"]) == (-1, -1, 0)
    assert "rotary_cos" not in kw and kw["pack_gqa"] is None  # only the schema's own names are passed
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and bool((out == 1).all())


def test_paged_fa3_fp8_needs_e4m3_queries_and_scales(fake_fa3):
    kp, _ = _pages(torch.float8_e4m3fn, "NHD")
    vp, _ = _pages(torch.float8_e4m3fn, "NHD")
    cu, table, lens = (torch.tensor([0, 8], dtype=torch.int32), torch.tensor([[0, 1]], dtype=torch.int32),
                       torch.tensor([24], dtype=torch.int32))
    qb = torch.randn(8, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="e4m3 queries"):
        vllm_fa3.PagedFA3(qb, kp, vp, cu, 8, table, lens, 24)
    q8 = qb.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="q_scale, k_scale and v_scale"):
        vllm_fa3.PagedFA3(q8, kp, vp, cu, 8, table, lens, 24, q_scale=torch.tensor([0.5]))
    f = vllm_fa3.PagedFA3(q8, kp, vp, cu, 8, table, lens, 24, q_scale=torch.tensor([0.5]), k_scale=torch.tensor([2.0]),
                          v_scale=torch.tensor([3.0, 4.0]))
    f()
    (kw,) = fake_fa3.fwd.calls
    assert kw["q_descale"].shape == (1, 2) and kw["q_descale"].tolist() == [[0.5, 0.5]]
    assert kw["v_descale"].tolist() == [[3.0, 4.0]] and kw["k_descale"].dtype == torch.float32
    assert kw["out"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="bf16 / fp16 or e4m3"):
        vllm_fa3.PagedFA3(qb, kp.to(torch.float32), vp.to(torch.float32), cu, 8, table, lens, 24)
