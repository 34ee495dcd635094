"""Full-page PNG screenshot of a kvbench HTML report with headless Chromium.

    python docs/scripts/screenshot_report.py runs/demo/report/report.html docs/example-report/report.png

Needs a Chromium (``$KVBENCH_CHROMIUM``, or chromium / chromium-browser / google-chrome on PATH).
Exit status 0 on success, 1 when Chromium fails, 2 for bad arguments or no Chromium."""

from __future__ import annotations

import argparse
import logging
import sys

from kvbench.reports.render.screenshot import ChromiumNotFound, capture


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report_html", help="the report page (report.html)")
    p.add_argument("out_png", help="where to write the PNG")
    p.add_argument("--width", type=int, default=1400, help="page width in pixels (default 1400)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per browser run (default 120)")
    p.add_argument("--colors", type=int, default=0,
                   help="reduce the PNG to this many palette colours (e.g. 256, for a smaller file in docs; needs Pillow)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")  # cut width or height
    try:
        info = capture(args.report_html, args.out_png, args.width, timeout=args.timeout)
    except (ChromiumNotFound, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.colors:
        from PIL import Image

        with Image.open(info["png"]) as im:
            small = im.convert("RGB").quantize(colors=args.colors, method=Image.Quantize.MEDIANCUT)
        small.save(info["png"], optimize=True)
    m = info["metrics"]
    broken = [im.get("alt") or f"#{i}" for i, im in enumerate(m["images"]) if not im["natural_width"]]
    print(f"{info['png']}: {info['width']}x{info['height']} px (page {info['page_width']}x{info['page_height']}), "
          f"{len(m['images'])} images, {info['chromium']}, {info['seconds']:.1f}s")
    if broken:
        print(f"warning: images that did not load: {', '.join(broken)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
