"""Full-page PNG screenshots of a report's HTML with headless Chromium (no other browser tooling needed).

Chromium's ``--screenshot`` captures one viewport, so a full page takes two runs:

1. measure: a small wrapper page holds the report in an ``<iframe>`` of the requested width and, when the
   frame has loaded, writes the report's layout (``scrollHeight``, ``scrollWidth``, the position and natural
   size of every ``<img>``) as JSON into its own DOM; ``--dump-dom`` prints that DOM (``page_metrics``);
2. capture: ``--screenshot`` of the report's own ``file://`` URL with ``--window-size=WIDTH,HEIGHT``, where
   HEIGHT is the measured page height and scrollbars are hidden (``screenshot`` / ``capture``).

The report file is opened read-only, as a ``file://`` URL; the wrapper page and the browser profile live in
a temporary directory that is removed afterwards.  Failures raise ``RuntimeError`` with the tail of
Chromium's stderr; a missing browser raises ``ChromiumNotFound`` (a ``RuntimeError``).

The binary: ``$KVBENCH_CHROMIUM``, else the first of chromium, chromium-browser, google-chrome on PATH.
"""

from __future__ import annotations

import html
import json
import logging
import os
import re
import shutil
import signal
import struct
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional, Union

__all__ = ["ChromiumNotFound", "find_chromium", "chromium_version", "page_metrics", "page_height", "capture",
           "screenshot", "png_size", "ENV_CHROMIUM", "MAX_HEIGHT"]

log = logging.getLogger("kvbench.report")

ENV_CHROMIUM = "KVBENCH_CHROMIUM"
CANDIDATES = ("chromium", "chromium-browser", "google-chrome")
MAX_HEIGHT = 50_000  # pixels; taller pages are cut there (with a warning): Chromium renders 40k px fine
_MEASURE_VIEWPORT = 900  # viewport height used while measuring (the page's own height is what counts)
_METRICS_ID = "kvbench-metrics"
PathLike = Union[str, os.PathLike]


class ChromiumNotFound(RuntimeError):
    """No Chromium binary: set KVBENCH_CHROMIUM or install chromium."""


def find_chromium() -> Optional[str]:
    """``$KVBENCH_CHROMIUM`` (a path or a name on PATH), else chromium, chromium-browser, google-chrome."""
    env = os.environ.get(ENV_CHROMIUM, "").strip()
    if env:
        if os.path.isfile(env) and os.access(env, os.X_OK):
            return env
        return shutil.which(env)
    for name in CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


def _binary(chromium: Optional[str]) -> str:
    found = chromium or find_chromium()
    if not found:
        env = os.environ.get(ENV_CHROMIUM, "").strip()
        if env:
            raise ChromiumNotFound(f"{ENV_CHROMIUM}={env} is not an executable file or a name on PATH")
        raise ChromiumNotFound(f"no Chromium found: set {ENV_CHROMIUM} or put one of {', '.join(CANDIDATES)} "
                               "on PATH (Debian: apt-get install chromium)")
    return found


def _tail(text: str, n: int = 15) -> str:
    """Last lines of Chromium's stderr, without the D-Bus noise it prints on machines without a session bus."""
    lines = [ln for ln in text.splitlines() if ln.strip() and "dbus" not in ln.lower()]
    return "\n".join(lines[-n:]) or "(no stderr)"


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run Chromium in its own process group so that a timeout ends the browser's helper processes too."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        raise RuntimeError(f"chromium timed out after {timeout:.0f}s: {' '.join(argv)}\n{_tail(err)}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


_VERSIONS: dict[str, str] = {}


def chromium_version(chromium: Optional[str] = None) -> str:
    """``chromium --version``, e.g. 'Chromium 150.0.7871.100 built on Debian GNU/Linux 12 (bookworm)'."""
    binary = _binary(chromium)
    if binary not in _VERSIONS:
        r = _run([binary, "--version"], timeout=30)
        text = r.stdout.strip().splitlines()
        if r.returncode != 0 or not text:
            raise RuntimeError(f"{binary} --version failed (exit {r.returncode}):\n{_tail(r.stderr)}")
        _VERSIONS[binary] = text[-1].strip()
    return _VERSIONS[binary]


def _flags(profile: Path, width: int, height: int) -> list[str]:
    return [
        "--headless",
        # The pages are local files written by kvbench; the sandbox cannot start as root and often not in
        # containers without user namespaces.
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        "--force-device-scale-factor=1",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-extensions",
        "--disable-background-networking",
        "--mute-audio",
        f"--user-data-dir={profile}",
        f"--window-size={width},{height}",
    ]


def _html_file(html_path: PathLike) -> Path:
    path = Path(html_path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"report page not found: {path}")
    return path


_WRAPPER = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><style>html,body{{margin:0;padding:0}}iframe{{border:0;display:block}}</style>
</head><body>
<iframe id="page" scrolling="no" style="width:{width}px;height:{height}px" src="{src}"></iframe>
<pre id="{mid}"></pre>
<script>
document.getElementById("page").addEventListener("load", function () {{
  var out = document.getElementById("{mid}"), res;
  try {{
    var d = this.contentDocument, e = d.documentElement, b = d.body || e;
    var imgs = Array.prototype.map.call(d.images, function (im) {{
      var r = im.getBoundingClientRect();
      return {{x: r.left, y: r.top, width: r.width, height: r.height, natural_width: im.naturalWidth,
               natural_height: im.naturalHeight, complete: im.complete, alt: im.alt || ""}};
    }});
    res = {{height: Math.max(e.scrollHeight, b.scrollHeight), width: Math.max(e.scrollWidth, b.scrollWidth),
            client_width: e.clientWidth, title: d.title, images: imgs}};
  }} catch (err) {{
    res = {{error: String(err)}};
  }}
  out.textContent = JSON.stringify(res);
}});
</script></body></html>
"""


def page_metrics(html_path: PathLike, width: int = 1400, *, chromium: Optional[str] = None,
                 timeout: float = 60.0) -> dict:
    """Lay the page out at ``width`` CSS pixels in headless Chromium and return what it measured.

    Keys: ``height`` (document scroll height), ``width`` (scroll width: more than ``width`` when something
    overflows horizontally), ``client_width``, ``title`` and ``images``: one dict per ``<img>`` in document
    order with ``x``, ``y``, ``width``, ``height`` (its box in page pixels), ``natural_width``,
    ``natural_height`` (0 when the image failed to load or decode), ``complete`` and ``alt``.
    """
    page = _html_file(html_path)
    binary = _binary(chromium)
    width = int(width)
    if width < 100:
        raise ValueError(f"width must be at least 100 pixels, got {width}")
    with tempfile.TemporaryDirectory(prefix="kvbench-shot-", ignore_cleanup_errors=True) as tmp:
        tmp_dir = Path(tmp)
        wrapper = tmp_dir / "measure.html"
        wrapper.write_text(_WRAPPER.format(width=width, height=_MEASURE_VIEWPORT, mid=_METRICS_ID,
                                           src=html.escape(page.as_uri(), quote=True)), encoding="utf-8")
        argv = [binary, *_flags(tmp_dir / "profile", width, _MEASURE_VIEWPORT),
                "--allow-file-access-from-files",  # the wrapper reads the frame's document (both file://)
                "--dump-dom", wrapper.as_uri()]
        r = _run(argv, timeout)
    m = re.search(rf'<pre id="{_METRICS_ID}">(.*?)</pre>', r.stdout, re.S)
    if r.returncode != 0 or not m or not m.group(1).strip():
        raise RuntimeError(f"chromium could not measure {page} (exit {r.returncode}"
                           f"{'' if m else ', no metrics in its DOM dump'}):\n{_tail(r.stderr)}")
    metrics = json.loads(html.unescape(m.group(1)))
    if "error" in metrics:
        raise RuntimeError(f"chromium could not read the page's layout: {metrics['error']}")
    metrics["height"] = int(metrics["height"])
    metrics["width"] = int(metrics["width"])
    return metrics


def page_height(html_path: PathLike, width: int = 1400, **kw) -> int:
    """Height in pixels of the whole page laid out ``width`` pixels wide (see ``page_metrics``)."""
    return page_metrics(html_path, width, **kw)["height"]


def png_size(path: PathLike) -> tuple[int, int]:
    """(width, height) from a PNG's header."""
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        raise RuntimeError(f"{path} is not a PNG file")
    return struct.unpack(">II", head[16:24])


def capture(html_path: PathLike, png_path: PathLike, width: int = 1400, *, chromium: Optional[str] = None,
            timeout: float = 120.0, max_height: int = MAX_HEIGHT) -> dict:
    """Screenshot the whole page ``width`` pixels wide into ``png_path``; returns what was done.

    Keys: ``png`` (Path), ``width``, ``height`` (of the PNG), ``page_height``, ``page_width`` (the page's
    scroll width: content wider than ``width`` is cut at the right edge), ``clipped`` (page taller than
    ``max_height``), ``chromium`` (its version string), ``seconds`` (both browser runs), ``metrics``
    (``page_metrics``).
    """
    t0 = time.monotonic()
    page = _html_file(html_path)
    binary = _binary(chromium)
    version = chromium_version(binary)
    metrics = page_metrics(page, width, chromium=binary, timeout=timeout)
    height = max(1, min(metrics["height"], int(max_height)))
    clipped = metrics["height"] > height
    if clipped:
        log.warning("%s is %d px tall; the screenshot stops at %d px", page, metrics["height"], height)
    if metrics["width"] > width:
        log.warning("%s is %d px wide at a %d px window; the screenshot cuts the right %d px",
                    page, metrics["width"], width, metrics["width"] - width)
    out = Path(png_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvbench-shot-", ignore_cleanup_errors=True) as tmp:
        tmp_dir = Path(tmp)
        shot = tmp_dir / "page.png"
        argv = [binary, *_flags(tmp_dir / "profile", width, height), f"--screenshot={shot}", page.as_uri()]
        r = _run(argv, timeout)
        if r.returncode != 0 or not shot.is_file() or shot.stat().st_size == 0:
            raise RuntimeError(f"chromium failed to screenshot {page} (exit {r.returncode}, "
                               f"{'no PNG written' if not shot.is_file() else 'PNG written'}):\n{_tail(r.stderr)}")
        got = png_size(shot)
        if got != (width, height):
            raise RuntimeError(f"chromium wrote a {got[0]}x{got[1]} screenshot of {page}, "
                               f"expected {width}x{height}:\n{_tail(r.stderr)}")
        shutil.move(str(shot), out)
    seconds = time.monotonic() - t0
    log.info("screenshot %s: %dx%d px with %s in %.1fs", out, width, height, version, seconds)
    return {"png": out, "width": width, "height": height, "page_height": metrics["height"],
            "page_width": metrics["width"], "clipped": clipped, "chromium": version, "seconds": seconds,
            "metrics": metrics}


def screenshot(html_path: PathLike, png_path: PathLike, width: int = 1400, **kw) -> Path:
    """Screenshot the whole page into ``png_path`` (PNG ``width`` pixels wide); returns its path.

    Logs the Chromium version and timing on the ``kvbench.report`` logger; ``capture`` returns them."""
    return capture(html_path, png_path, width, **kw)["png"]
