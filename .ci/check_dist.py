"""Checks the sdist and the wheel that ``python -m build`` made, before anyone uploads them.

    python .ci/check_dist.py DIST_DIR             # what the archives hold
    python .ci/check_dist.py DIST_DIR --install   # and the wheel, installed, works

What the archives hold, against this checkout's ``agang/``:

- the wheel holds every file of ``agang/`` (every subpackage, ``py.typed`` too) and
  nothing else: no ``tests/``, ``site/``, ``docs/``, ``examples/``, ``bench/``, no
  ``__pycache__``; its metadata says the version of ``agang/__init__.py``, the licence
  and its file, and the ``agang`` command;
- the sdist holds ``README.md`` (equal to this one, the page an index shows),
  ``LICENSE``, ``pyproject.toml`` and every file of ``agang/``, and no built site or
  virtual environment.

``--install`` installs the wheel with ``--no-deps`` into a throwaway virtual environment
that borrows this interpreter's installed packages (torch and the rest: nothing is
downloaded) but not its agang, then runs ``agang --version`` and imports every module of
the installed copy, and runs a collective on a ``FakeWorld`` from it. ``--python PATH``
makes that environment with another interpreter and then only runs ``agang --version``
and byte-compiles the installed copy (that interpreter has no torch).

Exit status 0 when every check passed; 1, with each problem on stderr, otherwise.
``tests/unit/test_packaging.py`` runs the archive checks on planted archives.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Top-level folders of the repository that must never travel in the wheel.
NOT_IN_WHEEL = ("tests", "site", "docs", "examples", "bench", "build", "dist", ".ci")
# Nor in the sdist: a built site, a virtual environment, caches.
NOT_IN_SDIST = ("site", ".venv", ".git", "build", "dist", ".mypy_cache", ".pytest_cache")


def source_version(root: Path = ROOT) -> str:
    """The version in ``agang/__init__.py``, read as text (importing would load agang)."""
    text = (root / "agang" / "__init__.py").read_text(encoding="utf-8")
    match = re.search(r'^__version__ = "([^"]+)"$', text, re.MULTILINE)
    if match is None:
        raise SystemExit(f"no __version__ line in {root / 'agang' / '__init__.py'}")
    return match[1]


def package_files(root: Path = ROOT) -> set[str]:
    """Every file of ``agang/`` as ``agang/...``, leaving out bytecode caches."""
    return {
        path.relative_to(root).as_posix()
        for path in (root / "agang").rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }


def check_wheel(wheel: Path, root: Path = ROOT) -> list[str]:
    """The problems of ``wheel``; empty when it holds what it should."""
    problems: list[str] = []
    version = source_version(root)
    info = f"agang-{version}.dist-info"
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if not n.endswith("/")]
        metadata = archive.read(f"{info}/METADATA").decode() if f"{info}/METADATA" in names else ""
        entry_points = (
            archive.read(f"{info}/entry_points.txt").decode()
            if f"{info}/entry_points.txt" in names
            else ""
        )
    tops = {name.split("/", 1)[0] for name in names}
    for top in sorted(tops - {"agang", info}):
        why = "must not be in the wheel" if top in NOT_IN_WHEEL else "is not agang's"
        problems.append(f"wheel: {top}/ {why}")
    if info not in tops:
        problems.append(f"wheel: no {info}/ (the version in agang/__init__.py is {version})")
    held = {n for n in names if n.startswith("agang/")}
    for name in sorted(package_files(root) - held):
        problems.append(f"wheel: {name} is missing")
    for name in sorted(held - package_files(root)):
        problems.append(f"wheel: {name} is not in the source tree")
    if "agang/py.typed" not in held:
        problems.append("wheel: agang/py.typed is missing (type checkers would ignore agang)")
    for name in names:
        if "__pycache__/" in name or name.endswith(".pyc"):
            problems.append(f"wheel: {name} is a bytecode cache")
    fields = dict(
        line.split(": ", 1) for line in metadata.split("\n\n", 1)[0].splitlines() if ": " in line
    )
    expected = {
        "Name": "agang",
        "Version": version,
        "License-Expression": "BSD-3-Clause",
        "License-File": "LICENSE",
        "Description-Content-Type": "text/markdown",
    }
    for field, value in expected.items():
        if fields.get(field) != value:
            problems.append(f"wheel: METADATA {field} is {fields.get(field)!r}, not {value!r}")
    if f"{info}/licenses/LICENSE" not in names:
        problems.append(f"wheel: {info}/licenses/LICENSE is missing")
    if not re.search(r"^agang = agang\.__main__:main$", entry_points, re.MULTILINE):
        problems.append("wheel: no `agang` command in entry_points.txt")
    return problems


def check_sdist(sdist: Path, root: Path = ROOT) -> list[str]:
    """The problems of ``sdist``; empty when it holds what it should."""
    problems: list[str] = []
    prefix = f"agang-{source_version(root)}/"
    with tarfile.open(sdist) as archive:
        members = {m.name: m for m in archive.getmembers() if m.isfile()}
        outside = sorted(n for n in members if not n.startswith(prefix))
        problems += [f"sdist: {n} is outside {prefix}" for n in outside]
        held = {n[len(prefix) :] for n in members if n.startswith(prefix)}
        for name in ("README.md", "LICENSE", "pyproject.toml", "PKG-INFO"):
            if name not in held:
                problems.append(f"sdist: {name} is missing")
        if "README.md" in held:
            readme = archive.extractfile(members[prefix + "README.md"])
            assert readme is not None
            if readme.read() != (root / "README.md").read_bytes():
                problems.append("sdist: README.md differs from the repository's")
    for name in sorted(package_files(root) - held):
        problems.append(f"sdist: {name} is missing")
    for top in sorted({n.split("/", 1)[0] for n in held if "/" in n} & set(NOT_IN_SDIST)):
        problems.append(f"sdist: {top}/ must not be in the sdist")
    return problems


def _run(command: list[str], cwd: str | None = None) -> str:
    # No PYTHONPATH: a checkout on it would stand in for the installed copy (and its
    # agang.egg-info would tell pip that agang is installed already).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(command, capture_output=True, text=True, check=False, env=env, cwd=cwd)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stdout}{result.stderr}")
    return result.stdout


# Run by the installed copy: every module imports, and a collective runs.
_IMPORT_ALL = """
import asyncio, importlib, pkgutil, sys
import agang, agang.testing, torch
assert agang.__file__.startswith(sys.argv[1]), agang.__file__
names = [m.name for m in pkgutil.walk_packages(agang.__path__, "agang.")]
for name in names:
    importlib.import_module(name)
async def step(gang):
    return (await gang.all_reduce(torch.ones(2) * (gang.rank + 1))).tolist()
assert asyncio.run(agang.testing.FakeWorld(3).run(step)) == [[6.0, 6.0]] * 3
print(f"all {len(names)} modules import; a FakeWorld all_reduce runs")
"""


def smoke(wheel: Path, python: str | None) -> None:
    """Installs ``wheel`` into a throwaway virtual environment and runs it (see above)."""
    with tempfile.TemporaryDirectory(prefix="agang-wheel-") as scratch:
        venv = Path(scratch) / "venv"
        maker = python or sys.executable
        _run([maker, "-m", "venv", "--without-pip", str(venv)])
        venv_python = str(venv / "bin" / "python")
        pip = [sys.executable, "-m", "pip", "--python", venv_python, "install", "--quiet"]
        _run([*pip, "--no-deps", "--no-index", str(wheel)])
        purelib = _run(
            [venv_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
        )
        site = Path(purelib.strip())
        version = _run([str(venv / "bin" / "agang"), "--version"], cwd=scratch).strip()
        if version != f"agang {source_version()}":
            raise SystemExit(f"agang --version printed {version!r}")
        print(f"installed wheel: `agang --version` printed {version!r}")
        if python is not None:
            _run([venv_python, "-m", "compileall", "-q", str(site / "agang")])
            print(f"installed wheel: every module byte-compiles on {python}")
            return
        # This interpreter's packages (torch...), as a plain path: their .pth files, and
        # with them the editable agang of a development install, are not read.
        (site / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        # From the scratch folder: `python -c` puts its folder first on sys.path.
        checked = _run([venv_python, "-c", _IMPORT_ALL, str(site)], cwd=scratch)
        print("installed wheel: " + checked.strip())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("dist", type=Path, help="the folder python -m build wrote into")
    parser.add_argument("--install", action="store_true", help="install the wheel and run it")
    parser.add_argument("--python", help="make the throwaway environment with this interpreter")
    args = parser.parse_args()
    wheels = sorted(args.dist.glob("agang-*.whl"))
    sdists = sorted(args.dist.glob("agang-*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        found = [p.name for p in wheels + sdists]
        print(f"expected one wheel and one sdist in {args.dist}, found {found}", file=sys.stderr)
        return 1
    problems = check_wheel(wheels[0]) + check_sdist(sdists[0])
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        return 1
    print(f"{wheels[0].name} and {sdists[0].name}: contents as expected")
    if args.install or args.python:
        smoke(wheels[0], args.python)
    return 0


if __name__ == "__main__":
    sys.exit(main())
