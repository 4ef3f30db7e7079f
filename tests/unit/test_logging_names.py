"""agang's loggers: ``agang`` and children of it, each written down in docs/logging.md.

``logging.getLogger("agang").setLevel(...)`` reaches every record agang logs, because
every logger agang uses is ``agang`` or a child of it; a child names the part a record
comes from, so a user can turn one part up or down alone.
"""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path

import pytest

import agang

PACKAGE = Path(agang.__file__).parent
DOCS = PACKAGE.parent / "docs" / "logging.md"


def logger_names() -> dict[str, set[str]]:
    """Each name passed to ``logging.getLogger`` in agang, with the modules that pass it."""
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "logging.getLogger":
                assert len(node.args) == 1, f"{path}:{node.lineno}: name the logger"
                name = node.args[0]
                assert isinstance(name, ast.Constant), f"{path}:{node.lineno}: a literal name"
                module = str(path.relative_to(PACKAGE.parent))
                found.setdefault(str(name.value), set()).add(module)
    return found


def documented_names() -> set[str]:
    """The logger names in the first column of docs/logging.md's table."""
    return set(re.findall(r"^\| `(agang(?:\.[a-z0-9_]+)*)` \|", DOCS.read_text(), re.MULTILINE))


def test_every_logger_is_agang_or_a_child_of_it() -> None:
    names = logger_names()
    assert "agang" in names or any(name.startswith("agang.") for name in names)
    assert all(name == "agang" or name.startswith("agang.") for name in names), names


def test_the_parts_have_loggers_of_their_own() -> None:
    names = logger_names()
    assert all(module.startswith("agang/_setup/") for module in names["agang.setup"])
    assert names["agang.setup"] >= {"agang/_setup/init.py", "agang/_setup/rendezvous.py"}
    assert names["agang.store"] == {"agang/_cli/store.py"}


def test_the_loggers_are_the_documented_ones() -> None:
    assert DOCS.read_text().startswith("# Logging\n")
    assert documented_names() == set(logger_names())


def test_set_up_logs_under_agang_setup_and_agang_turns_it_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="agang")

    agang.init_sync(env={}).close_sync()  # no launcher: an in-process gang, said at INFO

    (record,) = [r for r in caplog.records if "in-process gang" in r.getMessage()]
    assert record.name == "agang.setup"
    assert record.levelno == logging.INFO
