"""The test suite's own rules: a run says what it is, and every skip says why.

A newcomer's first ``pytest`` should tell them how long it will take, which lane they
are in and which loops the async tests run on (``tests/conftest.py``'s report header),
and a skipped test should say what it needs (``-rs`` prints the reasons).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]  # tests/, above unit/
REPO = TESTS.parent
# Calls that skip or expect failure, and where each takes its reason: a positional
# argument (index), or only the ``reason=`` keyword (None).
SKIPS: dict[str, int | None] = {
    "pytest.skip": 0,
    "pytest.xfail": 0,
    "pytest.importorskip": None,
    "pytest.mark.skip": None,
    "pytest.mark.skipif": None,
    "pytest.mark.xfail": None,
}


def reasonless_skips(root: Path = TESTS) -> list[str]:
    """Every skip under ``root`` whose call gives no reason, or one too short to say why."""
    found: list[tuple[Path, int, str]] = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(_with_parents(ast.parse(path.read_text()))):
            if isinstance(node, ast.Call):
                called = ast.unparse(node.func)
            elif isinstance(node, ast.Attribute):  # ``@pytest.mark.skip`` without a call
                called = ast.unparse(node)
            else:
                continue
            if called not in SKIPS:
                continue
            where = (path, node.lineno, called)
            if not isinstance(node, ast.Call):
                parent = getattr(node, "parent", None)
                called_here = isinstance(parent, ast.Call) and parent.func is node
                if called.startswith("pytest.mark.") and not called_here:
                    found.append(where)  # a mark used bare: no reason at all
                continue
            index = SKIPS[called]
            reason = next((k.value for k in node.keywords if k.arg in ("reason", "msg")), None)
            if reason is None and index is not None and len(node.args) > index:
                reason = node.args[index]
            if reason is None or (
                isinstance(reason, ast.Constant) and len(str(reason.value).split()) < 3
            ):
                found.append(where)
    return [f"{path.relative_to(root)}:{line} {called}" for path, line, called in sorted(found)]


def _with_parents(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            child.parent = node  # type: ignore[attr-defined]
    return tree


def test_every_skip_says_why() -> None:
    assert reasonless_skips() == []


def test_the_check_catches_a_planted_skip_without_reason(tmp_path: Path) -> None:
    (tmp_path / "test_planted.py").write_text(
        "import pytest\n"
        "np = pytest.importorskip('numpy')\n"
        "@pytest.mark.skipif(True, reason='the planted condition holds here')\n"
        "def test_a(): pytest.skip('no')\n"
        "@pytest.mark.skipif(False)\n"
        "def test_b(): pytest.skip(reason='this one says why it skips')\n"
        "@pytest.mark.xfail\n"
        "def test_c(): pytest.raises(pytest.skip.Exception, pytest.skip, msg='why it skips')\n"
    )
    assert reasonless_skips(tmp_path) == [
        "test_planted.py:2 pytest.importorskip",
        "test_planted.py:4 pytest.skip",
        "test_planted.py:5 pytest.mark.skipif",
        "test_planted.py:7 pytest.mark.xfail",
    ]


def header_lines(config: pytest.Config) -> list[str]:
    results = config.hook.pytest_report_header(config=config, start_path=REPO)
    return [
        line for result in results for line in ([result] if isinstance(result, str) else result)
    ]


def test_the_header_says_the_lanes_their_cost_and_the_loops(request: pytest.FixtureRequest) -> None:
    text = " ".join(" ".join(header_lines(request.config)).split())

    assert "agang's tests" in text
    assert '-m "not slow"' in text
    assert "about 115 s" in text
    assert "15 minutes on a 2-core machine" in text
    assert "asyncio, asyncio+uvloop and trio" in text


@pytest.mark.slow  # runs pytest in a process of its own
def test_a_run_announces_its_lane_and_counts_its_tests() -> None:
    arguments = ["--collect-only", "-n", "0", "-m", "not slow"]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", *arguments, "tests/unit/test_layout.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    assert result.returncode == 0, result.stdout + result.stderr
    assert "this run: the fast lane" in result.stdout, result.stdout
    assert "tests selected:" in result.stdout, result.stdout
