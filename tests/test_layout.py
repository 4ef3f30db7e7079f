"""The package's shape: small modules, no import circles, no citations outside the repo.

A newcomer reads the layout as the architecture (``_engine``, ``_backends``, ``_setup``,
``_cli``); these checks keep it readable as it grows.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import agang

ROOT = Path(agang.__file__).parent
MODULES = sorted(ROOT.rglob("*.py"))
MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = ["agang", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The agang modules ``path`` imports at module level (not under TYPE_CHECKING, not
    inside functions: those run later, once every module is loaded)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: agang uses absolute imports"
            base = node.module or ""
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                names.add(candidate if _is_module(candidate) else base)
    return {name for name in names if name == "agang" or name.startswith("agang.")}


def _is_module(name: str) -> bool:
    relative = Path(*name.split(".")[1:])
    return (ROOT / relative).with_suffix(".py").exists() or (
        ROOT / relative / "__init__.py"
    ).exists()


def test_no_module_is_over_500_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in MODULES
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_no_import_circle() -> None:
    graph = {_module_name(p): _imports(p) for p in MODULES}
    # Importing a submodule runs its packages' __init__ first; those only re-export, so a
    # package's own __init__ importing its children is not an edge back.
    for name, targets in graph.items():
        graph[name] = {
            t for t in targets if t in graph and not name.startswith(f"{t}.") and t != "agang"
        }
    visiting: list[str] = []
    done: set[str] = set()

    def visit(name: str) -> None:
        if name in done:
            return
        assert name not in visiting, " -> ".join([*visiting[visiting.index(name) :], name])
        visiting.append(name)
        for target in sorted(graph[name]):
            visit(target)
        visiting.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def test_the_code_cites_no_document_outside_the_repository() -> None:
    outside = re.compile(r"design\.md|facts\.md|fault[- ]matrix|nccl-audit|style\.md|\.\./shared")
    tests = sorted(Path(__file__).parent.glob("*.py"))
    cited = [
        f"{p.name}:{i}"
        for p in [*MODULES, *tests]
        if p.name != Path(__file__).name
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if outside.search(line)
    ]
    assert cited == []


def test_every_folder_is_a_regular_package() -> None:
    # A folder without __init__.py is a namespace package: an editable install finds it,
    # but a built wheel leaves it out (setuptools' find_packages skips it).
    folders = {p.parent for p in MODULES}
    assert (
        sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").exists()) == []
    )
