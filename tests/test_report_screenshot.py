"""The self-contained HTML report in a real headless Chromium: full-page PNG, plots decoded, no broken <img>.

Chromium comes from $KVBENCH_CHROMIUM or PATH.  Without one these tests skip, unless
KVBENCH_REQUIRE_CHROMIUM=1 (CI sets it after installing chromium), where they fail."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import io
import os
import re
import stat
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from kvbench.harness.cli import app
from kvbench.reports.render import screenshot as shot

sys.path.insert(0, str(Path(__file__).parent))
from test_reports_load import make_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WIDTH = 1200
VIEWPORT = 900  # a typical first viewport: the report must be taller than this


def _fake_browser(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(path)


@pytest.fixture(scope="module")
def chromium():
    found = shot.find_chromium()
    if found is None:
        env = os.environ.get(shot.ENV_CHROMIUM, "").strip()
        why = (f"no Chromium: {shot.ENV_CHROMIUM}={env} is not an executable" if env else
               f"no Chromium: set {shot.ENV_CHROMIUM} or install chromium "
               f"(looked for {', '.join(shot.CANDIDATES)} on PATH)")
        if os.environ.get("KVBENCH_REQUIRE_CHROMIUM") == "1":
            pytest.fail(why + "; KVBENCH_REQUIRE_CHROMIUM=1 requires it")
        pytest.skip(why)
    return found


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shot")
    run = make_run(tmp / "run", failed=("fp8_e5m2",),
                   drops={"bf16": 0.0, "fp8_e4m3": 0.02, "fp8_e5m2": 0.1, "nvfp4": 0.35})
    r = CliRunner().invoke(app, ["report", str(run), "--out", str(tmp / "rep"), "--bootstrap", "200"])
    assert r.exit_code == 0, r.stdout
    return tmp / "rep" / "report.html"


@pytest.fixture(scope="module")
def captured(chromium, report, tmp_path_factory):
    before = hashlib.sha256(report.read_bytes()).hexdigest()
    png = tmp_path_factory.mktemp("png") / "sub" / "report.png"
    t0 = time.monotonic()
    info = shot.capture(report, png, WIDTH, chromium=chromium)
    info["wall"] = time.monotonic() - t0
    assert hashlib.sha256(report.read_bytes()).hexdigest() == before  # the page is only read
    img = np.asarray(Image.open(png).convert("RGB")).astype(np.int16)
    return info, img


# ---------------------------------------------------------------------------------- without a browser


def test_find_chromium_order(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    chrome = _fake_browser(bin_dir / "google-chrome", "exit 0")
    browser = _fake_browser(bin_dir / "chromium-browser", "exit 0")
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv(shot.ENV_CHROMIUM, raising=False)
    assert shot.find_chromium() == browser  # chromium-browser before google-chrome
    mine = _fake_browser(tmp_path / "my-chrome", "exit 0")
    monkeypatch.setenv(shot.ENV_CHROMIUM, mine)
    assert shot.find_chromium() == mine  # the environment variable first
    monkeypatch.setenv(shot.ENV_CHROMIUM, "google-chrome")
    assert shot.find_chromium() == chrome  # a name on PATH
    monkeypatch.setenv(shot.ENV_CHROMIUM, str(tmp_path / "missing"))
    assert shot.find_chromium() is None  # an explicit choice that does not exist is not silently replaced
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv(shot.ENV_CHROMIUM)
    assert shot.find_chromium() is None
    with pytest.raises(shot.ChromiumNotFound, match=shot.ENV_CHROMIUM):
        shot.page_height(__file__)
    monkeypatch.setenv(shot.ENV_CHROMIUM, str(tmp_path / "missing"))
    with pytest.raises(shot.ChromiumNotFound, match="missing is not an executable"):
        shot.screenshot(__file__, tmp_path / "x.png")


def test_failures_raise_with_stderr_tail(tmp_path):
    page = tmp_path / "p.html"
    page.write_text("<!DOCTYPE html><p>x</p>")
    bad = _fake_browser(tmp_path / "bad", 'echo "Chromium 1.2.3"; echo "fatal: no display here" >&2; exit 3')
    with pytest.raises(RuntimeError, match=r"(?s)exit 3.*fatal: no display here"):
        shot.capture(page, tmp_path / "o.png", chromium=bad)
    assert not (tmp_path / "o.png").exists()
    slow = _fake_browser(tmp_path / "slow", 'echo "Chromium 1.2.3"; echo "starting" >&2; exec sleep 30')
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)timed out after 1s.*starting"):
        shot.page_metrics(page, chromium=slow, timeout=1)
    assert time.monotonic() - t0 < 10
    with pytest.raises(FileNotFoundError):
        shot.capture(tmp_path / "nope.html", tmp_path / "o.png", chromium=bad)


# ---------------------------------------------------------------------------------- in Chromium


def test_png_covers_the_whole_page(captured, report, chromium):
    info, img = captured
    h = shot.page_height(report, WIDTH, chromium=chromium)
    assert img.shape[1] == WIDTH == info["width"]
    assert img.shape[0] == h == info["height"] == info["page_height"] and not info["clipped"]
    assert h > 2 * VIEWPORT  # a long page: more than the first viewport was captured
    assert shot.png_size(info["png"]) == (WIDTH, h)
    assert re.match(r"(Chromium|Google Chrome) \d+\.", info["chromium"]), info["chromium"]
    # content reaches the bottom: the last rows of the page (the cells table, then the body margin) are not empty
    tail = img[-160:]
    assert (np.abs(tail - 255).sum(axis=2) > 60).mean() > 0.002
    print(f"screenshot {img.shape[1]}x{img.shape[0]} in {info['wall']:.2f}s with {info['chromium']}")


def test_png_is_not_blank(captured):
    _, img = captured
    assert float(img.std()) > 20
    assert (img.sum(axis=2) < 200).mean() > 0.002  # dark text pixels


def test_every_image_loaded_and_is_painted_where_it_sits(captured, report):
    info, img = captured
    images = info["metrics"]["images"]
    page = report.read_text()
    srcs = re.findall(r"<img[^>]*\ssrc='data:image/png;base64,([^']+)'", page)
    assert len(images) == len(srcs) == 7  # accuracy, deltas, accuracy_throughput, fidelity, serving, latency, capacity
    for im in images:
        assert im["complete"] and im["natural_width"] > 0 and im["natural_height"] > 0, im
    for im, src in zip(images, srcs):
        want = Image.open(io.BytesIO(base64.b64decode(src))).convert("RGB")
        assert (im["natural_width"], im["natural_height"]) == want.size
        # the <img> box has a 1 px border; inside it the plot is drawn at its natural size, or scaled down
        # (max-width:100%) when wider than the page
        x0, y0 = round(im["x"] + 1), round(im["y"] + 1)
        x1, y1 = round(im["x"] + im["width"] - 1), round(im["y"] + im["height"] - 1)
        assert 0 <= x0 < x1 <= img.shape[1] and 0 <= y0 < y1 <= img.shape[0], im
        region = img[y0:y1, x0:x1]
        colored = (region.max(axis=2) - region.min(axis=2)) > 60
        assert colored.mean() > 0.001, f"{im['alt']}: no colored pixels where the plot sits"
        scaled = want.size != (x1 - x0, y1 - y0)
        if scaled:
            want = want.resize((x1 - x0, y1 - y0), Image.Resampling.BILINEAR)
        ref = np.asarray(want).astype(np.int16)
        ink = np.abs(ref - 255).sum(axis=2) > 60  # the plot's lines, bars, text
        assert ink.mean() > 0.01, im["alt"]
        diff = np.abs(region - ref).mean()
        ink_diff = np.abs(region - ref)[ink].mean()  # an empty box would be off by about 100 here
        # drawn at natural size the plot is pixel-exact; scaled, Chromium's filter differs from Pillow's a little
        assert diff < (4 if scaled else 1), f"{im['alt']}: the screenshot differs from the inlined PNG by {diff:.1f}"
        assert ink_diff < (30 if scaled else 2), f"{im['alt']}: the plot's lines differ by {ink_diff:.1f}"


def test_broken_images_are_reported(chromium, tmp_path):
    ok = base64.b64encode(_png_bytes()).decode()
    page = tmp_path / "p.html"
    page.write_text("<!DOCTYPE html><html><body style='margin:0'>"
                    f"<img alt='good' src='data:image/png;base64,{ok}'>"
                    "<img alt='bad' src='data:image/png;base64,AAAAAAAA'>"
                    "<div style='height:3000px;background:#36c'></div></body></html>")
    m = shot.page_metrics(page, 800, chromium=chromium)
    assert [(i["alt"], i["natural_width"] > 0) for i in m["images"]] == [("good", True), ("bad", False)]
    assert m["images"][0]["natural_width"] == 40 and m["images"][0]["width"] == 40
    assert 3000 < m["height"] < 3100 and m["width"] == 800


def test_script_writes_png_and_flags_broken_images(chromium, report, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(shot.ENV_CHROMIUM, chromium)
    spec = importlib.util.spec_from_file_location("screenshot_report", ROOT / "docs/scripts/screenshot_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "r.png"
    assert mod.main([str(report), str(out), "--width", "900"]) == 0
    assert shot.png_size(out)[0] == 900
    assert "900x" in capsys.readouterr().out
    broken = tmp_path / "b.html"
    broken.write_text("<!DOCTYPE html><img alt='plot' src='data:image/png;base64,AAAA'>")
    assert mod.main([str(broken), str(tmp_path / "b.png")]) == 1
    assert "did not load: plot" in capsys.readouterr().err
    assert mod.main([str(tmp_path / "none.html"), str(tmp_path / "n.png")]) == 2


def _png_bytes() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()
