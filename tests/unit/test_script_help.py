"""The examples' and benches' ``--help`` shows every option's default.

Each script's parser uses ``argparse.ArgumentDefaultsHelpFormatter``: a reader learns
what ``python examples/async_trainer.py`` will do without reading its code. The fast
check reads the scripts; the slow one runs each ``--help`` (the scripts start together:
most of their time is importing torch) and finds each literal default in it.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(
    path
    for folder in ("examples", "bench")
    for path in (REPO / folder).glob("*.py")
    if "ArgumentParser(" in path.read_text()
)
IDS = [str(path.relative_to(REPO)) for path in SCRIPTS]


def _calls(path: Path, name: str) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(name)
    ]


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def literal_defaults(path: Path) -> list[str]:
    """The defaults written as literals in ``path``'s shown ``add_argument`` calls, as
    ``--help`` prints them."""
    found = []
    for call in _calls(path, ".add_argument"):
        default, shown = _keyword(call, "default"), _keyword(call, "help")
        if shown is not None and ast.unparse(shown).endswith("SUPPRESS"):
            continue
        if isinstance(default, ast.Constant) and default.value is not None:
            found.append(str(default.value))
    return found


def test_there_are_scripts_to_check() -> None:
    assert {"examples/async_trainer.py", "bench/bench_overhead.py"} <= set(IDS)


def test_every_example_parses_its_arguments() -> None:
    """Every example has a parser, so ``--help`` prints its usage and exits 0 instead of
    running the demo (``examples/hello.py --help`` ran it)."""
    examples = sorted(str(path.relative_to(REPO)) for path in (REPO / "examples").glob("*.py"))
    assert examples
    assert [path for path in examples if path not in IDS] == []


@pytest.mark.parametrize("path", SCRIPTS, ids=IDS)
def test_every_parser_shows_the_defaults(path: Path) -> None:
    parsers = _calls(path, "ArgumentParser")
    assert parsers
    for parser in parsers:
        formatter = _keyword(parser, "formatter_class")
        where = f"{path.name}:{parser.lineno}: ArgumentParser(..., "
        fix = "formatter_class=argparse.ArgumentDefaultsHelpFormatter), and a help= per option"
        assert formatter is not None, where + fix
        assert ast.unparse(formatter).endswith("ArgumentDefaultsHelpFormatter"), where + fix


@pytest.fixture(scope="module")
def helps() -> dict[Path, subprocess.CompletedProcess[str]]:
    """Every script's ``--help``, run all at once."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    started = {
        path: subprocess.Popen(
            [sys.executable, str(path), "--help"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for path in SCRIPTS
    }
    done = {}
    for path, process in started.items():
        out, err = process.communicate(timeout=120)
        done[path] = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    return done


@pytest.mark.slow  # runs every script's --help in a process of its own
@pytest.mark.parametrize("path", SCRIPTS, ids=IDS)
def test_help_shows_each_default(
    path: Path, helps: dict[Path, subprocess.CompletedProcess[str]]
) -> None:
    result = helps[path]
    assert result.returncode == 0, result.stderr
    text = re.sub(r"\s+", " ", result.stdout)
    assert "(default: " in text
    for default in literal_defaults(path):
        assert f"(default: {default})" in text, (default, result.stdout)
