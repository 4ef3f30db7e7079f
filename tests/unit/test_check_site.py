"""docs/tools/check_site.py sees each defect it exists for, and passes a clean page.

The check runs on the built site in CI (after ``mkdocs build --strict``, which passes all
of these); here it reads small pages shaped as mkdocstrings renders them.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_site", ROOT / "docs/tools/check_site.py")
    assert spec
    assert spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_site"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


check_site = _load()


def _entry(heading: str, body: str) -> str:
    return (
        f'<div class="doc doc-object doc-class"><h2 id="{heading}" class="doc doc-heading">'
        f'{heading}</h2><div class="doc doc-contents">{body}</div></div>'
    )


def _attributes_table(*rows: str) -> str:
    cells = "".join(
        f'<tr class="doc-section-item"><td><code>{row}</code></td><td></td>'
        f"<td><p>What it is.</p></td></tr>"
        for row in rows
    )
    return (
        '<p><span class="doc-section-title">Attributes:</span></p>'
        f"<table><thead><tr><th>Name</th><th>Type</th><th>Description</th></tr></thead>"
        f"<tbody>{cells}</tbody></table>"
    )


CLEAN = _entry(
    "agang.GangInitError",
    '<p>Setting up failed; see <a href="#agang.init"><code>init</code></a>.</p>'
    '<details class="example" open><summary>Example</summary>'
    '<div class="highlight"><pre><code>&gt;&gt;&gt; gang = await agang.init()\n'
    "x = 1  # :func: in code is fine</code></pre></div></details>"
    + _attributes_table('<a href="#agang.CollectiveError.context">context</a>')
    + '<h3 id="agang.GangInitError.attempts">attempts</h3><p>How many.</p>',
) + _entry("agang.CollectiveError.context", "<p>Where the op ran.</p>")


def _kinds(html: str) -> list[str]:
    return [defect.kind for defect in check_site.check_html(html)]


def test_a_clean_page_passes() -> None:
    assert check_site.check_html(CLEAN) == []


@pytest.mark.parametrize(
    ("html", "kind"),
    [
        (
            _entry("agang.Gang", "<p>Closed by :meth: <code>close</code>.</p>"),
            "role",
        ),
        (_entry("agang.init", "<p>See :class:`agang.Gang`.</p>"), "role"),
        (
            _entry(
                "agang.init",
                '<details class="example"><summary>Example</summary><blockquote><blockquote>'
                "<blockquote><p>gang = await agang.init()</p></blockquote></blockquote>"
                "</blockquote></details>",
            ),
            "quoted-example",
        ),
        (_entry("agang.init", "<p>&gt;&gt;&gt; gang = await agang.init()</p>"), "quoted-example"),
        (
            _entry(
                "agang.GangInitError",
                _attributes_table('<a href="#agang.GangInitError.attempts">attempts</a>')
                + '<h3 id="agang.GangInitError.attempts">attempts</h3>'
                "<pre><code>attempts = attempts</code></pre>",
            ),
            "duplicate-attribute",
        ),
        (
            _entry("agang.Handle", '<h3 id="agang.Handle.seq">seq</h3><h3 id="agang.Handle.seq">'),
            "duplicate-attribute",
        ),
    ],
    ids=["role", "role-with-backticks", "nested-quotes", "prompt", "table-and-entry", "twice"],
)
def test_a_defect_is_found(html: str, kind: str) -> None:
    assert _kinds(html) == [kind]


def test_the_command_fails_on_a_defect_and_passes_a_clean_site(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "api").mkdir()
    (tmp_path / "api" / "index.html").write_text(CLEAN)
    assert check_site.main(["check_site", str(tmp_path)]) == 0
    (tmp_path / "index.html").write_text(_entry("agang", "<p>Use :func: <code>init</code>.</p>"))
    assert check_site.main(["check_site", str(tmp_path)]) == 1
    assert "index.html: role: :func:" in capsys.readouterr().out
    assert check_site.main(["check_site", str(tmp_path / "missing")]) == 2
