"""The package as an index would get it.

``.ci/check_dist.py`` checks the sdist and the wheel that CI builds; here its checks run on
planted archives (one as the build makes it, and ones with a part missing or a part too
many), so a checker that quietly stopped seeing is itself caught, without a build.
"""

from __future__ import annotations

import importlib.util
import io
import tarfile
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

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
