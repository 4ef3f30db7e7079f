"""The package as an index would get it, and the README's tested-versions table.

``.ci/check_dist.py`` checks the sdist and the wheel that CI builds; here its checks run on
planted archives (one as the build makes it, and ones with a part missing or a part too
many), so a checker that quietly stopped seeing is itself caught, without a build.

The README's table lists only what has been run. Its rows must cover every Python version
the classifiers claim and the floors of ``pyproject.toml``, each row must say what backs
it, and in CI (``AGANG_CI=1``, set by ``.ci/run``) the running Python, torch and OS must be
those of the row that CI backs.
"""

from __future__ import annotations

import importlib.util
import io
import os
import platform
import re
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _load_check_dist() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_dist", ROOT / ".ci" / "check_dist.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_dist = _load_check_dist()
VERSION = check_dist.source_version()
INFO = f"agang-{VERSION}.dist-info"
METADATA = (
    "Metadata-Version: 2.4\nName: agang\nVersion: {version}\nLicense-Expression: BSD-3-Clause\n"
    "License-File: LICENSE\nDescription-Content-Type: text/markdown\n\n# agang\n"
)


def plant_wheel(path: Path, *, leave_out: str = "", add: str = "", version: str = VERSION) -> Path:
    """A wheel as the build makes it, less ``leave_out`` and plus ``add``."""
    with zipfile.ZipFile(path, "w") as archive:
        for name in sorted(check_dist.package_files()):
            if name != leave_out:
                archive.writestr(name, (ROOT / name).read_bytes())
        archive.writestr(f"{INFO}/METADATA", METADATA.format(version=version))
        archive.writestr(f"{INFO}/licenses/LICENSE", "BSD-3-Clause")
        archive.writestr(
            f"{INFO}/entry_points.txt", "[console_scripts]\nagang = agang.__main__:main\n"
        )
        if add:
            archive.writestr(add, "")
    return path


def plant_sdist(path: Path, *, leave_out: str = "", add: str = "") -> Path:
    """An sdist as the build makes it, less ``leave_out`` and plus ``add``."""
    names = ["README.md", "LICENSE", "pyproject.toml", *sorted(check_dist.package_files())]
    with tarfile.open(path, "w:gz") as archive:
        for name in [*names, "PKG-INFO", add]:
            if not name or name == leave_out:
                continue
            data = (ROOT / name).read_bytes() if (ROOT / name).is_file() else b""
            member = tarfile.TarInfo(f"agang-{VERSION}/{name}")
            member.size = len(data)
            archive.addfile(member, io.BytesIO(data))
    return path


def test_a_wheel_as_built_passes(tmp_path: Path) -> None:
    assert check_dist.check_wheel(plant_wheel(tmp_path / "a.whl")) == []


@pytest.mark.parametrize(
    ("planted", "problem"),
    [
        ({"leave_out": "agang/py.typed"}, "wheel: agang/py.typed is missing"),
        ({"leave_out": "agang/testing/__init__.py"}, "wheel: agang/testing/__init__.py is missing"),
        ({"add": "tests/conftest.py"}, "wheel: tests/ must not be in the wheel"),
        ({"add": "site/index.html"}, "wheel: site/ must not be in the wheel"),
        ({"add": "agang/__pycache__/x.pyc"}, "wheel: agang/__pycache__/x.pyc is a bytecode cache"),
        ({"version": "0.0.9"}, "wheel: METADATA Version is '0.0.9', not"),
    ],
)
def test_the_wheel_check_catches_a_planted_fault(
    tmp_path: Path, planted: dict[str, str], problem: str
) -> None:
    problems = check_dist.check_wheel(plant_wheel(tmp_path / "a.whl", **planted))
    assert any(p.startswith(problem) for p in problems), problems


def test_an_sdist_as_built_passes(tmp_path: Path) -> None:
    assert check_dist.check_sdist(plant_sdist(tmp_path / "a.tar.gz")) == []


@pytest.mark.parametrize(
    ("planted", "problem"),
    [
        ({"leave_out": "LICENSE"}, "sdist: LICENSE is missing"),
        ({"leave_out": "README.md"}, "sdist: README.md is missing"),
        ({"leave_out": "agang/_gang.py"}, "sdist: agang/_gang.py is missing"),
        ({"add": "site/index.html"}, "sdist: site/ must not be in the sdist"),
    ],
)
def test_the_sdist_check_catches_a_planted_fault(
    tmp_path: Path, planted: dict[str, str], problem: str
) -> None:
    problems = check_dist.check_sdist(plant_sdist(tmp_path / "a.tar.gz", **planted))
    assert problem in problems, problems


# The README's tested-versions table.


def version_table(readme: str | None = None) -> list[dict[str, str]]:
    """The rows of the README's "Tested versions" table, by column name."""
    text = readme if readme is not None else (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Tested versions\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    header, rows = cells[0], cells[2:]
    assert header == ["Python", "torch", "OS and device", "backed by"], header
    return [dict(zip(header, row, strict=True)) for row in rows]


def ci_row() -> dict[str, str]:
    [row] = [row for row in version_table() if row["backed by"].startswith("CI:")]
    return row


PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def test_every_python_the_classifiers_claim_has_a_row() -> None:
    prefix = "Programming Language :: Python :: "
    claimed = {
        c[len(prefix) :] for c in PYPROJECT["classifiers"] if re.match(prefix + r"3\.\d+$", c)
    }
    listed = {v for row in version_table() for v in row["Python"].split(", ")}
    assert claimed, PYPROJECT["classifiers"]
    assert claimed <= listed, f"classifiers claim {sorted(claimed - listed)}: give them a row"


def test_the_floors_of_pyproject_are_rows() -> None:
    python_floor = PYPROJECT["requires-python"].removeprefix(">=")
    [torch_floor] = [
        d.removeprefix("torch>=") for d in PYPROJECT["dependencies"] if d.startswith("torch>=")
    ]
    rows = version_table()
    assert any(python_floor in row["Python"].split(", ") for row in rows), python_floor
    assert any(row["torch"].startswith(torch_floor + ",") for row in rows), torch_floor


def test_every_row_says_what_backs_it() -> None:
    for row in version_table():
        backing = row["backed by"]
        # CI's own runs, or a run by hand with its date, or an honest "untested".
        assert backing.startswith("CI:") or re.search(r"\b20\d\d-\d\d-\d\d\b", backing), row
        if not backing.startswith("CI:"):
            assert "not CI" in backing or "untested" in backing, row


def test_the_table_parser_reads_a_planted_table() -> None:
    readme = (
        "x\n## Tested versions\n\nwords\n\n| Python | torch | OS and device | backed by |\n"
        "| --- | --- | --- | --- |\n| 3.11 | 2.13.0, CPU build | Linux | CI: each run |\n\n"
        "more words\n\n## Next\n| a | b |\n"
    )
    assert version_table(readme) == [
        {
            "Python": "3.11",
            "torch": "2.13.0, CPU build",
            "OS and device": "Linux",
            "backed by": "CI: each run",
        }
    ]


@pytest.mark.skipif(
    os.environ.get("AGANG_CI") != "1",
    reason="only CI's own run (AGANG_CI=1, set by .ci/run) must be the README's CI row",
)
def test_this_ci_run_is_the_ci_row() -> None:
    row = ci_row()
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    torch_version, _, build = torch.__version__.partition("+")
    assert python in row["Python"].split(", "), (python, row)
    assert row["torch"].startswith(torch_version + ","), (torch.__version__, row)
    assert ("CPU build" in row["torch"]) == (build == "cpu"), (torch.__version__, row)
    release = platform.freedesktop_os_release()
    system = f"{platform.system()} ({release['ID'].capitalize()} {release.get('VERSION_ID', '')})"
    assert row["OS and device"].startswith(system), (system, row)
