"""The version lives in one place, and ``agang --version`` prints it."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import agang

ROOT = Path(__file__).resolve().parents[3]


def test_agang_version_prints_the_packages_version() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "agang", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"agang {agang.__version__}"


def test_the_version_is_written_once() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project  # read from agang/__init__.py at build time
    assert project["dynamic"] == ["version"]
    assert importlib.metadata.version("agang") == agang.__version__


def test_the_licence_ships_with_the_package() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "BSD-3-Clause"
    assert (ROOT / "LICENSE").read_text().startswith("BSD 3-Clause License")
