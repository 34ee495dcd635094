"""Host-side logic of the kernel benchmarks (the timings themselves need a GPU): configuration choice in
the prefill rows, and the issue-3 target table."""

from kvbench.tools import append_bench as A
from kvbench.tools import common as CM
from kvbench.tools import decode_bench as D
from kvbench.tools import kernel_bench as B
from kvbench.tools import prefill_bench as BP


def test_best_config_skips_failures_and_reports_the_defaults(monkeypatch):
    times = {None: 5.0, (128, 64, 64, 8, 3): 4.0, (128, 128, 128, 8, 2): 3.0}

    def fake_bench(fn):
        return fn()

    def run(kw):
        cfg = tuple(kw[k] for k in BP._KEYS) if kw else None
        if cfg not in times:
            raise RuntimeError("out of resource: shared memory")
        return times[cfg]

    monkeypatch.setattr(BP, "_bench", fake_bench)
    t, cfg, dflt = BP._best(run, "test")
    assert (t, cfg, dflt) == (3.0, (128, 128, 128, 8, 2), 5.0)
    assert BP._note(3, cfg, dflt) == "best of 3: (128, 128, 128, 8, 2); defaults 5.0 us"
    t, cfg, dflt = BP._best(lambda kw: (_ for _ in ()).throw(RuntimeError("no")), "all fail")
    assert cfg is None and dflt is None and t != t  # NaN when nothing ran


def test_prefill_targets_use_the_extend_rows():
    pre = {"sdpa": 550.0, "triton": 440.0, "extend_bf16": 1430.0, "extend_fp8_e4m3": 1580.0,
           "extend_fp8_e4m3_fp8_q": 1345.0}
    res = {name: (ok, detail) for name, ok, detail in B._targets(4000.0, [], {}, {}, pre, {})}
    assert res["prefill bf16 >= 0.8x SDPA TFLOP/s"] == (True, "0.80x")
    ok, detail = res["prefill fp8 prefix >= 0.9x its bf16 speed"]
    assert ok and detail == "0.91x (with fp8 queries: 1.06x)"
    pre["extend_fp8_e4m3_converted_K"] = 1650.0  # the K-tile conversion the default replaces, reported beside it
    res = {name: (ok, detail) for name, ok, detail in B._targets(4000.0, [], {}, {}, pre, {})}
    assert res["prefill fp8 prefix >= 0.9x its bf16 speed"][1] == "0.91x (converted K tiles: 0.87x; with fp8 queries: 1.06x)"
    pre["extend_fp8_e4m3"] = 1600.0
    res = {name: (ok, detail) for name, ok, detail in B._targets(4000.0, [], {}, {}, pre, {})}
    assert res["prefill fp8 prefix >= 0.9x its bf16 speed"][0] is False


def test_append_bytes_counts_the_unfused_k_round_trip():
    # 512 bf16 tokens, 32 q / 8 kv heads of 128: q read + rotated q written (4 MiB each), k read + rotated
    # k written (1 MiB each), v read (1 MiB), cache rows written; the unfused path reads the rotated k again.
    mib = 1 << 20
    fused, unfused = A.append_bytes(512, 32, 8, 128, 256)
    assert fused == 4 * mib * 2 + mib * 2 + mib + 2 * mib
    assert unfused == fused + mib
    fused8, unfused8 = A.append_bytes(512, 32, 8, 128, 128)  # fp8 rows: half the cache bytes
    assert fused - fused8 == mib and unfused - unfused8 == mib
    assert A.append_bytes(0, 32, 8, 128, 256) == (0, 0)


def test_decode_targets_read_the_chosen_layout_rows():
    """The decode rows carry their page layout at the end of the name; the format stays the third word."""
    rows = [B.Row("decode triton bf16 B64x8192 32/8 D128 p16 HND", 500.0, 4300.0, 100.0),
            B.Row("decode triton fp8_e4m3 B64x8192 32/8 D128 p16 HND", 270.0, 4000.0, 94.0)]
    res = {name: (ok, detail) for name, ok, detail in B._targets(4300.0, rows, {"bf16": 500.0, "fp8_e4m3": 270.0},
                                                                   {}, {}, {})}
    assert res["decode fp8 >= 80% of copy bandwidth"] == (True, "94%")
    assert res["decode fp8 >= 1.8x faster than bf16"] == (True, "1.85x")


def test_flashinfer_gets_hnd_memory_as_its_own_shape():
    import torch

    from kvbench.tools.kernel_check import as_layout

    x = torch.randn(5, 16, 8, 32)
    k, v = CM.fi_kv(as_layout(x, "HND"), as_layout(2 * x, "HND"), "HND")
    assert k.shape == (5, 8, 16, 32) and k.is_contiguous() and v.is_contiguous()
    assert torch.equal(k, x.permute(0, 2, 1, 3))
    kn, _ = CM.fi_kv(x, x, "NHD")
    assert kn is x


def test_bench_cli_rejects_an_unknown_layout():
    from typer.testing import CliRunner

    from kvbench.harness.cli import app

    r = CliRunner().invoke(app, ["bench", "kernels", "--layout", "HDN"])
    assert r.exit_code == 2 and "HND or NHD" in r.output


def test_decode_sweep_builds_its_caches_in_the_chosen_layout(monkeypatch):
    """The sweep's cases go through ``_decode_case`` with the layout it was given (host side: the case
    builder is replaced by one that records its arguments and stops the run)."""
    import pytest

    seen = []

    def case(*a):
        seen.append(a[-1])
        raise RuntimeError("stop")

    monkeypatch.setattr(D, "decode_case", case)
    for layout in ("HND", "NHD"):
        with pytest.raises(RuntimeError, match="stop"):
            D.sweep_decode(1.0, formats=("bf16",), layout=layout)
    assert seen == ["HND", "NHD"]


def test_bench_cli_rejects_an_unknown_part():
    from typer.testing import CliRunner

    from kvbench.harness.cli import app

    r = CliRunner().invoke(app, ["bench", "kernels", "--parts", "decode,mlaa"])
    text = " ".join(r.output.replace("│", " ").split())  # the message as one line, out of its box
    assert r.exit_code == 2 and "unknown part(s) ['mlaa']: choose from decode, prefill, append, mla" in text, r.output


def test_mla_part_runs_the_mla_benchmarks(monkeypatch, tmp_path):
    """``--parts mla`` hands over to ``kvbench.tools.mla_check`` (its own checks only with ``--check``, the
    small grid with ``--quick``, its tables next to ``--out``) and returns its exit status; nothing of the GQA
    benchmark runs (host side: CUDA reported present, the MLA entry point recorded)."""
    import torch

    from kvbench.tools import mla_check

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mla_check, "main", lambda argv: calls.append(argv) or 3)
    monkeypatch.setattr(B, "copy_bandwidth", lambda *a: (_ for _ in ()).throw(AssertionError("GQA part ran")))
    out = str(tmp_path / "bench.json")
    assert B.main(parts="mla", out=out) == 3
    assert B.main(parts="mla", check=True, quick=True) == 3
    assert calls == [["--skip-checks", "--out", str(tmp_path / "bench_mla")], ["--quick", "--no-sweep"]]
    assert B.parse_parts("decode,mla") == ["decode", "mla"]
    assert "mla" in B.main.__defaults__[4]  # the default parts include it


def test_graph_timings_wait_for_pending_writes_before_the_side_stream(monkeypatch):
    """triton's ``do_bench_cudagraph`` replays on a stream of its own that does not wait for the caller's: both
    graph-timing helpers synchronize after the first (compiling) call and before handing over (host side:
    the device calls recorded in order)."""
    import torch
    import triton.testing

    from kvbench.tools import mla_common

    seen = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: seen.append("sync"))
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda fn, **k: seen.append("graph") or 1.0)
    for timed in (lambda f: CM.bench_us(f, graph=True), mla_common.graph_time_us):
        seen.clear()
        assert timed(lambda: seen.append("call")) == 1e3
        assert seen == ["call", "sync", "graph"], seen
