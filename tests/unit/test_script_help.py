"""The examples' and benches' ``--help`` shows every option's default.

Each script's parser uses ``argparse.ArgumentDefaultsHelpFormatter``: a reader learns
what ``python examples/async_trainer.py`` will do without reading its code. The fast
check reads the scripts; the slow one runs each ``--help`` (one after another in one
interpreter, which imports torch once) and finds each literal default in it.
"""

from __future__ import annotations

import ast
import json
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


# Runs each script given as ``python SCRIPT --help`` would (``sys.argv``, the script's
# folder first on ``sys.path``, ``__main__``), one after another in one interpreter, and
# prints each one's exit code, stdout and stderr as JSON.
HELP_EACH = """
import contextlib, io, json, runpy, sys
found = {}
for path in sys.argv[1:]:
    out, err, code = io.StringIO(), io.StringIO(), None
    argv, first = sys.argv, sys.path[0]
    sys.argv, sys.path[0] = [path, "--help"], path.rsplit("/", 1)[0]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as exit:
        code = exit.code
    except BaseException as error:
        code = f"raised {error!r}"
    finally:
        sys.argv, sys.path[0] = argv, first
    found[path] = [code, out.getvalue(), err.getvalue()]
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def helps() -> dict[Path, subprocess.CompletedProcess[str]]:
    """Every script's ``--help``, all in one interpreter: most of a script's start is
    importing torch, which one process does once (on the 2-core machine, 2026-11-29:
    3 s, where a process a script took 19 s). The output is the same as a process of
    its own gives (checked for every script when this was made)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    paths = [str(path) for path in SCRIPTS]
    run = subprocess.run(
        [sys.executable, "-c", HELP_EACH, *paths],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    found = json.loads(run.stdout)
    return {
        path: subprocess.CompletedProcess([path, "--help"], *found[str(path)]) for path in SCRIPTS
    }


@pytest.mark.slow  # runs every script's --help (one interpreter, importing torch)
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
