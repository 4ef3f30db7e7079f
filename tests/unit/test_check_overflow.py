"""docs/tools/check_overflow.py sees a code block cut off at 1280 px, and passes one that fits.

It drives Chromium through Playwright: without either, these tests skip (CI installs both
before the tests run).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # starts a browser


def _load() -> ModuleType:
    path = ROOT / "docs/tools/check_overflow.py"
    spec = importlib.util.spec_from_file_location("check_overflow", path)
    assert spec
    assert spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_overflow"] = module
    spec.loader.exec_module(module)
    return module


check_overflow = _load()


def _page(*blocks: str) -> str:
    # The layout of a Material page, reduced to what the check reads: a column of the
    # width a page's column has at 1280 px, and its code blocks.
    pres = "".join(f"<pre><code>{block}</code></pre>" for block in blocks)
    return (
        "<html><head><style>pre code { display: block; overflow: auto; "
        "font: 13.6px monospace; padding: 0 16px; }</style></head><body>"
        f'<div class="md-content" style="width: 688px"><div class="md-content__inner">'
        f"{pres}</div></div></body></html>"
    )


@pytest.fixture
def browser_ready() -> None:
    pytest.importorskip("playwright.sync_api", reason="Playwright is not installed")
    if check_overflow._chromium() is None:
        pytest.skip("Chromium is not installed (Debian package chromium)")


@pytest.mark.usefixtures("browser_ready")
def test_a_cut_off_block_is_found_and_one_that_fits_passes(tmp_path: Path) -> None:
    (tmp_path / "index.html").write_text(_page("x = 1  # fits"))
    folded = (
        '<details class="example scrolls"><summary>the whole file</summary>'
        f"<pre><code>{'y' * 200}</code></pre></details>"
    )
    (tmp_path / "folded.html").write_text(
        _page("z = 2").replace("</div></div>", folded + "</div></div>")
    )
    assert check_overflow.check(tmp_path, None) == []

    # A folded block is measured too: the check opens every <details>.
    hidden = f'<details class="example"><pre><code>{"w" * 120}</code></pre></details>'
    (tmp_path / "wide.html").write_text(
        _page("short").replace("</div></div>", hidden + "</div></div>")
    )
    [finding] = check_overflow.check(tmp_path, tmp_path / "shots")
    assert finding.startswith("wide.html: code ")
    assert "w" * 20 in finding
