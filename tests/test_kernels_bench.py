"""Host-side logic of the kernel benchmarks (the timings themselves need a GPU): configuration choice in
the prefill rows, and the issue-3 target table."""

from kvbench.kernels import bench as B
from kvbench.kernels import bench_prefill as BP


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
