"""docs/architecture.md's tree is the package's: every folder and module of agang/ is in
it, one line each, and nothing in it is gone.

A page that describes the package as it was is worse than none: a newcomer trusts it.
The tree is the part of the page a test can hold to the code, so it is held here; the
call paths below it name modules of that tree.
"""

from __future__ import annotations

import re
from pathlib import Path

import agang

ROOT = Path(agang.__file__).parent
PAGE = ROOT.parent / "docs" / "architecture.md"
# One entry of the tree: its indentation (4 characters a level), then its name.
_ENTRY = re.compile(r"^((?:│   |    )*)(?:├── |└── )(\S+)")


def tree_of(text: str) -> set[str]:
    """The paths the page's tree lists (folders end with ``/``), relative to agang/."""
    blocks = re.findall(r"^## The tree\n.*?^```\n(.*?)^```", text, re.M | re.S)
    assert len(blocks) == 1, "the page has one '## The tree' section with one code block"
    lines = blocks[0].splitlines()
    assert lines[0].strip() == "agang/", lines[0]
    listed: set[str] = set()
    folders: list[str] = []  # the folder of each level, outermost first
    for line in lines[1:]:
        match = _ENTRY.match(line)
        if match is None:  # a description's continuation
            assert not line.strip() or line.strip()[0] == "│", line
            continue
        level = len(match.group(1)) // 4
        assert level <= len(folders), f"{line!r} is deeper than the folder above it"
        del folders[level:]
        name = match.group(2)
        path = "".join(folders) + name
        assert path not in listed, f"{path} is listed twice"
        listed.add(path)
        if name.endswith("/"):
            folders.append(name)
    return listed


def package_tree(root: Path = ROOT) -> set[str]:
    """Every package folder (``name/``) and module (and ``py.typed``) under ``root``."""
    found: set[str] = set()
    for path in root.rglob("*"):
        if "__pycache__" in path.parts:
            continue
        relative = path.relative_to(root).as_posix()
        if path.is_dir() and (path / "__init__.py").exists():
            found.add(f"{relative}/")
        elif path.suffix == ".py" or path.name == "py.typed":
            found.add(relative)
    return found


def test_the_architecture_page_lists_every_folder_and_module_of_agang() -> None:
    listed, actual = tree_of(PAGE.read_text()), package_tree()
    assert sorted(actual - listed) == [], "in agang/ but not in docs/architecture.md's tree"
    assert sorted(listed - actual) == [], "in docs/architecture.md's tree but gone from agang/"


def test_the_tree_reader_sees_nesting_and_what_is_missing() -> None:
    page = (
        "## The tree\n\ntext\n\n```\nagang/\n├── __init__.py   the face\n"
        "├── _engine/      the engine\n│   ├── __init__.py\n│   └── engine.py  the kernel\n"
        "│                  a continued description\n└── _errors.py\n```\n"
    )
    assert tree_of(page) == {
        "__init__.py",
        "_engine/",
        "_engine/__init__.py",
        "_engine/engine.py",
        "_errors.py",
    }
