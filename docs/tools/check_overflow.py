"""Checks, in a real headless browser, that no code on the built site is cut off.

    python docs/tools/check_overflow.py [SITE_DIR] [--screenshots DIR]

Serves SITE_DIR (default: site) on 127.0.0.1, opens every page in Chromium at a
1280x800 viewport (a laptop's window) and fails (exit 1) on a code block whose lines are
wider than the block: the reader must scroll sideways to see the end of a line (the API
reference's signatures and examples, the guides' commands and programs). At 1280 px a
code block of a page shows about 80 characters, one in an API entry's example a few
less. Each finding names the page, the widest line and by how many pixels it is too
wide. With ``--screenshots`` it saves a few pages as PNG.

It drives the system's Chromium (Debian's ``chromium`` package) through Playwright (PyPI
``playwright``; its own browser download is not needed). Where either is missing it
skips (exit 0) and says why, so a machine without them still runs the rest of CI.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import sys
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

WIDTH, HEIGHT = 1280, 800  # the viewport: a laptop's window
SCREENSHOTS = ["index.html", "getting-started/index.html", "api/gangs/index.html"]
CHROMIUM = ("chromium", "chromium-browser", "google-chrome")

# Runs in the page: opens every <details> (a folded block is measured too), then finds
# every code block wider inside than its box, but for one inside an element of class
# "scrolls": a whole file of examples/ shown as it is (ruff formats it at 100 columns),
# folded, as ``??? example scrolls "examples/NAME.py"`` (docs/guides/weights.md).
MEASURE = """() => {
  for (const details of document.querySelectorAll('details')) details.open = true;
  const found = [];
  const widest = (code) => {
    let best = '';
    for (const line of code.textContent.split('\\n')) if (line.length > best.length) best = line;
    return best;
  };
  for (const pre of document.querySelectorAll('.md-content pre')) {
    if (pre.closest('.scrolls') || pre.getClientRects().length === 0) continue;
    const code = pre.querySelector('code') || pre;
    const over = code.scrollWidth - code.clientWidth;
    if (over > 1) found.push({what: 'code', over, width: code.clientWidth, line: widest(code)});
  }
  return found;
}"""


def _serve(site: Path) -> ThreadingHTTPServer:
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def _chromium() -> str | None:
    for name in CHROMIUM:
        if path := shutil.which(name):
            return path
    return None


def check(site: Path, screenshots: Path | None) -> list[str]:
    """One line per cut-off code block of ``site``."""
    from playwright.sync_api import sync_playwright  # type: ignore[import-not-found,unused-ignore]

    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html"))
    server = _serve(site)
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    findings: list[str] = []
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=_chromium())
            page = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
            for name in pages:
                page.goto(base + name, wait_until="load")
                for item in page.evaluate(MEASURE):
                    line = " ".join(item["line"].split())
                    shown = f": '{line[:70]}...'" if len(line) > 70 else f": '{line}'"
                    findings.append(
                        f"{name}: {item['what']} {item['over']} px wider than its "
                        f"{item['width']} px{shown if line else ''}"
                    )
                if screenshots is not None and name in SCREENSHOTS:
                    screenshots.mkdir(parents=True, exist_ok=True)
                    out = screenshots / (name.replace("/index.html", "").replace("/", "-"))
                    page.screenshot(path=str(out.with_suffix(".png")), full_page=False)
            browser.close()
    finally:
        server.shutdown()
    return findings


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("site", nargs="?", default="site", type=Path)
    parser.add_argument("--screenshots", type=Path, default=None)
    args = parser.parse_args(argv[1:])
    if not any(args.site.rglob("*.html")):
        print(f"check_overflow: no HTML under {args.site}/: build the site first")
        return 2
    try:
        import playwright.sync_api  # type: ignore[import-not-found,unused-ignore]  # noqa: F401
    except ImportError:
        print("check_overflow: skipped: Playwright is not installed (pip install playwright)")
        return 0
    if _chromium() is None:
        print("check_overflow: skipped: no Chromium (apt-get install chromium)")
        return 0
    started = time.monotonic()
    findings = check(args.site, args.screenshots)
    for finding in findings:
        print(finding)
    pages = sum(1 for _ in args.site.rglob("*.html"))
    seconds = time.monotonic() - started
    print(f"check_overflow: {pages} pages at 1280x800 in {seconds:.0f} s; {len(findings)} cut off")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
