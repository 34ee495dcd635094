"""The scripts under docs/scripts/ that the docs cite: each imports without running anything and answers
``--help`` on a CPU machine; the host-side parts of the kernel probes (launch-option parsing, presets, the
HND emulation, which runs here through the Triton interpreter) and of the engine layout probe."""

from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "docs" / "scripts"
PY_SCRIPTS = sorted(p.name for p in SCRIPTS.glob("*.py"))
# scripts without an option parser: they take a positional argument only (their import is still checked)
NO_HELP: set = set()


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_script_{Path(name).stem}", SCRIPTS / name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_scripts_are_found():
    assert {"kernel_probes.py", "engine_layouts.py", "mla_probes.py"} <= set(PY_SCRIPTS)
    assert NO_HELP <= set(PY_SCRIPTS)


@pytest.mark.parametrize("name", [n for n in PY_SCRIPTS if n not in NO_HELP])
def test_help(name):
    r = subprocess.run([sys.executable, str(SCRIPTS / name), "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("usage:"), r.stdout[:200]


@pytest.mark.parametrize("name", PY_SCRIPTS)
def test_import_runs_nothing(name):
    mod = _load(name)
    assert callable(getattr(mod, "main", None))
    assert (mod.__doc__ or "").strip()


# ------------------------------------------------------------------------------------ kernel_probes
@pytest.fixture(scope="module")
def kp():
    return _load("kernel_probes.py")


def test_parse_config(kp):
    assert kp.parse_config("defaults") == {} and kp.parse_config(" ") == {}
    assert kp.parse_config("block_n=128,maxnreg=0,tma=false,fp8_qk=true,num_splits=none") == dict(
        block_n=128, maxnreg=0, tma=False, fp8_qk=True, num_splits=None)
    assert kp.parse_configs("defaults;num_splits=2") == [{}, {"num_splits": 2}]
    with pytest.raises(ValueError, match="unknown launch option 'block_m'"):
        kp.parse_config("block_m=64", kp.DECODE_KEYS)
    with pytest.raises(ValueError, match="key=value"):
        kp.parse_config("block_n")
    with pytest.raises(ValueError):
        kp.parse_config("block_n=big")
    assert kp.label({}) == "defaults" and kp.label({"block_n": 64, "tma": True}) == "block_n=64, tma=True"


def test_launch_keys_are_the_kernels_keyword_arguments(kp):
    # the kernels take their launch options as one object each (kernels.config)
    from kvbench.kernels.config import DecodeOptions, PrefillOptions

    assert set(kp.DECODE_KEYS) <= set(inspect.signature(DecodeOptions).parameters)
    # fp8_q is the probe's own switch (e4m3 queries with a scale), not a kernel argument
    assert set(kp.PREFILL_KEYS) - {"fp8_q"} <= set(inspect.signature(PrefillOptions).parameters)


def test_presets(kp):
    from kvbench.tools.common import kernel_formats

    for name, p in kp.DECODE_PRESETS.items():
        assert p["layout"] in ("HND", "NHD")
        for fmt, cfgs in p["formats"].items():
            assert fmt in kernel_formats(), (name, fmt)
            parsed = [kp.parse_config(c, kp.DECODE_KEYS) for c in cfgs]
            assert len({tuple(sorted(c.items())) for c in parsed}) == len(parsed), name  # no duplicates
    grid = [kp.parse_config(c) for c in kp.DECODE_PRESETS["grid-1634"]["formats"]["fp8_e4m3"]]
    assert grid[0] == {} and len(grid) == 1 + 2 * 3 * 3 * 2 * 3
    assert {c["num_warps"] for c in grid[1:]} == {1, 2} and {c["maxnreg"] for c in grid[1:]} == {0, 128, 168}
    caps = kp.DECODE_PRESETS["caps-1424"]["formats"]
    assert kp.parse_config(caps["fp8_e4m3"][0]) == dict(block_n=256, num_warps=8, num_stages=2, maxnreg=0)
    assert kp.parse_config(caps["nvfp4"][0]) == dict(block_n=64, num_warps=4, num_stages=2, maxnreg=0, num_splits=2)
    for name, p in kp.PREFILL_PRESETS.items():
        for shape, fmt, cfg in p["cases"]:
            assert len(shape) == 7 and fmt in kernel_formats(), name
            kp.parse_config(cfg, kp.PREFILL_KEYS)
    pages = {shape[6] for shape, _, _ in kp.PREFILL_PRESETS["pages-1158"]["cases"]}
    assert pages == {16, 64, 128}
    tma = [kp.parse_config(c) for _, _, c in kp.PREFILL_PRESETS["tma-1241"]["cases"]]
    # every pointer-load case has its descriptor twin, plus the 8k prompt at (128, 128) and 16 × 512 at (64, 64)
    assert sum(c["tma"] for c in tma) == sum(not c["tma"] for c in tma) + 2


def test_extend_flops_match_the_benchmark(kp):
    from kvbench.tools.decode_bench import BenchResults
    from kvbench.tools.prefill_bench import PrefillBench

    pb = PrefillBench(BenchResults())
    assert kp.extend_flops(pb.b, pb.pre, pb.new, pb.hq, pb.d) == pb.fl
    assert kp.extend_flops(1, 0, pb.seq, pb.hq, pb.d) == pb.flops


def test_arguments(kp, capsys):
    a = kp.parse_args(["decode", "--batches", "60,64", "--configs", "defaults;num_splits=4"])
    assert a.batches == [60, 64] and a.formats == "fp8_e4m3" and a.layout is None
    a = kp.parse_args(["prefill", "--shapes", "16:0:512,4:7168:1024", "--heads", "64:8"])
    assert a.shapes == [(16, 0, 512), (4, 7168, 1024)] and a.heads == (64, 8)
    for bad, why in ((["prefill", "--preset", "caps-1424"], "does not apply to prefill"),
                     (["decode", "--configs", "block_m=64"], "unknown launch option 'block_m'")):
        with pytest.raises(SystemExit):
            kp.parse_args(bad)
        assert why in capsys.readouterr().err


def test_no_cuda_device_is_a_message(kp, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device"):
        kp.main(["decode"])


def _uniform_cache(fmt, pages, page, hk, d, gen):
    from kvbench.kernels.formats import get_format
    from kvbench.tools.kernel_check import as_layout

    x = torch.randn(pages + 1, page, hk, d, generator=gen)
    scale = torch.full((hk,), float(x.abs().max()) / 448, dtype=torch.float32)
    q = get_format(fmt).quantize(x, scale)
    return as_layout(q.data, "HND"), as_layout(q.block_scale, "HND"), scale


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3"])
def test_hnd_emulation_reads_the_same_tokens(kp, fmt):
    from kvbench.kernels.config import DecodeOptions, PagedKV
    from kvbench.kernels.decode import paged_decode
    from kvbench.tools.kernel_check import random_page_table

    gen = torch.Generator().manual_seed(0)
    b, hq, hk, d, page, lens = 2, 4, 2, 16, 4, [11, 6]
    npg = sum(-(-n // page) for n in lens) + 1
    kc, kbs, ks = _uniform_cache(fmt, npg, page, hk, d, gen)
    vc, vbs, vs = _uniform_cache(fmt, npg, page, hk, d, gen)
    table = random_page_table(lens, page, npg, gen, "cpu")
    seq = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(b, hq, d, generator=gen)
    qe, ke, ve, kbe, vbe, te, le = kp.emulated_hnd_args(q, kc, vc, kbs, vbs, table, seq)
    assert ke.shape == ((npg + 1) * hk, page, 1, kc.shape[3]) and ke.is_contiguous()
    assert te[1 * hk + 1, 0] == table[1, 0] * hk + 1 and le.tolist() == [11, 11, 6, 6]
    # sequence 1, kv head 1, page 0, compared as bytes
    assert torch.equal(ke[int(te[hk + 1, 0]), :, 0].view(torch.uint8), kc[int(table[1, 0]), :, 1].view(torch.uint8))
    one = DecodeOptions(block_n=16, num_splits=1)
    ref = paged_decode(q, PagedKV(fmt, kc, vc, ks, vs), table, seq, opts=one)
    got = paged_decode(qe, PagedKV(fmt, ke, ve, ks[:1], vs[:1]), te, le, opts=one)
    torch.testing.assert_close(got.reshape(b, hq, d), ref, rtol=1e-5, atol=1e-5)
    wrong = paged_decode(qe, PagedKV(fmt, ke, ve, ks[:1], vs[:1]), te.flip(0), le,
                         opts=one)  # the pages of other (sequence, head)s: the check must notice
    assert (wrong.reshape(b, hq, d) - ref).abs().max() > 1e-2


def test_hnd_emulation_refuses_nhd_planes(kp):
    kc = torch.zeros(3, 4, 2, 16)
    with pytest.raises(ValueError, match="HND"):
        kp.emulated_hnd_args(torch.zeros(1, 4, 16), kc, kc, None, None, torch.zeros(1, 2, dtype=torch.int32),
                             torch.ones(1, dtype=torch.int32))


def _doc_commands(script: str) -> list[list[str]]:
    """The arguments of every command line of ``script`` quoted in docs/kernels.md (also the short forms
    `decode --preset ...` that follow a full one)."""
    import re
    import shlex

    text = (SCRIPTS.parents[0] / "kernels.md").read_text()
    def spans(pattern):
        return [shlex.split(" ".join(m.group(1).split())) for m in re.finditer(pattern, text)]

    full = [argv[2:] for argv in spans(rf"`(python docs/scripts/{re.escape(script)}(?:\s[^`]*)?)`")]
    short = spans(r"`((?:decode|prefill) --[^`]+)`") if script == "kernel_probes.py" else []
    return full + short


def test_the_commands_quoted_in_the_docs_parse(kp):
    cmds = _doc_commands("kernel_probes.py")
    assert len(cmds) >= 10
    presets = set()
    for argv in cmds:
        a = kp.parse_args(argv)
        presets.add(a.preset)
    assert presets - {None} == {*kp.DECODE_PRESETS, *kp.PREFILL_PRESETS}  # every preset is cited, none unknown


def test_engine_layouts_command_in_the_docs_parses(monkeypatch):
    el = _load("engine_layouts.py")
    cmds = _doc_commands("engine_layouts.py")
    assert cmds
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in cmds:
        with pytest.raises(SystemExit, match="no CUDA device"):  # past the argument parser
            el.main(argv)


# ------------------------------------------------------------------------------------ engine_layouts
def test_engine_layouts_helpers():
    el = _load("engine_layouts.py")
    assert el.parse_pairs("triton+triton, triton+flashinfer") == [("triton", "triton"), ("triton", "flashinfer")]
    with pytest.raises(ValueError):
        el.parse_pairs("triton")
    assert el.first_divergence([1, 2, 3], [1, 2, 3]) == 3 and el.first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert el.first_divergence([1, 2], [1, 2, 3]) == 2
    assert el.compare([[1, 2], [3, 4], [5]], [[1, 2], [3, 9], [5]]) == (2, [2, 1, 1])


# ------------------------------------------------------------------------------------ decode_probes
def test_decode_probes_sets_fill_from_the_module_defaults():
    dp = _load("decode_probes.py")
    from kvbench.kernels import decode_nv4

    assert dp.DEFAULTS == (decode_nv4.UNPACK, decode_nv4.STAGES, decode_nv4.VSWZ, decode_nv4.CPL, decode_nv4.HALVES)
    assert dp.parse_sets("1,2,1,3,1;0,0;;9") == [(1, 2, True, 3, True), (0, 0, True, 4, True),
                                                 (9, 2, True, 4, True)]
    assert dp.parse_sets("") == []
