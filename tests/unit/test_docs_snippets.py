"""The Python blocks of the docs (docs/**/*.md) and of README.md cannot rot.

Every ```python block is one of three kinds, told apart by the line before it:

- ``<!-- not-run: REASON -->``: an illustrative fragment (it needs a GPU, a DeviceMesh of
  several processes, an ``agang store``...). It is not run, and the reason must say why.
- a block whose lines are all ``--8<-- "examples/NAME.py"``: a whole example file included
  by pymdownx.snippets; the file must exist under ``examples/`` (the examples have tests
  of their own).
- anything else is a complete program, run here in-process in a fresh namespace (the
  blocks use ``agang.testing.FakeWorld``, ``SimulatedNccl`` or an in-process gang), so it
  must be self-contained. ``<!-- run: slow -->`` marks one that starts processes; it runs
  in the slow lane only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]

_FENCE = re.compile(r"^```python\s*$")
_NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(?P<reason>.*?)\s*-->$")
_RUN_SLOW = re.compile(r"^<!--\s*run:\s*slow\s*-->$")
_INCLUDE = re.compile(r'^--8<--\s+"(?P<path>[^"]+)"$')


@dataclass(frozen=True)
class Block:
    file: Path
    line: int  # 1-based line of the opening fence
    code: str
    marker: str  # the line before the fence, stripped ("" if blank)

    @property
    def name(self) -> str:
        return f"{self.file.relative_to(ROOT)}:{self.line}"


def python_blocks(path: Path) -> list[Block]:
    """Every ```python block of ``path``, with the nearest non-blank line above it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        if _FENCE.match(lines[i]):
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            assert j < len(lines), f"{path}:{i + 1}: unclosed ```python block"
            k = i - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            marker = lines[k].strip() if k >= 0 else ""
            blocks.append(Block(path, i + 1, "\n".join(lines[i + 1 : j]) + "\n", marker))
            i = j
        i += 1
    return blocks


ALL_BLOCKS = [b for f in DOC_FILES for b in python_blocks(f)]


def _includes(block: Block) -> list[str] | None:
    """The included paths if the block is only snippet includes, else None."""
    found = [_INCLUDE.match(line.strip()) for line in block.code.splitlines() if line.strip()]
    if found and all(found):
        return [m["path"] for m in found if m]
    return None


def _kind(block: Block) -> str:
    if _NOT_RUN.match(block.marker):
        return "not-run"
    if _includes(block) is not None:
        return "include"
    return "run"


def test_the_docs_have_python_blocks_of_every_kind() -> None:
    kinds = {_kind(b) for b in ALL_BLOCKS}
    assert kinds == {"run", "include", "not-run"}, kinds


def test_fragments_that_are_not_run_are_few_and_say_why() -> None:
    fragments = [b for b in ALL_BLOCKS if _kind(b) == "not-run"]
    for block in fragments:
        match = _NOT_RUN.match(block.marker)
        assert match, block.name
        assert len(match["reason"]) >= 10, f"{block.name}: give the reason"
    # Most blocks run: an illustrative fragment is the exception.
    assert len(fragments) * 3 <= len(ALL_BLOCKS), [b.name for b in fragments]


@pytest.mark.parametrize(
    "block", [b for b in ALL_BLOCKS if _kind(b) == "include"], ids=lambda b: b.name
)
def test_an_included_block_names_an_example_that_exists(block: Block) -> None:
    for path in _includes(block) or []:
        assert path.startswith("examples/"), (block.name, path)
        assert path.endswith(".py"), (block.name, path)
        assert (ROOT / path).is_file(), (block.name, path)


def _runnable() -> list[object]:
    params: list[object] = []
    for block in ALL_BLOCKS:
        if _kind(block) != "run":
            continue
        marks = [pytest.mark.slow] if _RUN_SLOW.match(block.marker) else []
        params.append(pytest.param(block, id=block.name, marks=marks))
    return params


@pytest.mark.parametrize("block", _runnable())
def test_a_runnable_block_runs(block: Block) -> None:
    code = compile(block.code, block.name, "exec")
    namespace: dict[str, object] = {"__name__": "__main__"}  # as `python block.py` runs it
    exec(code, namespace)  # a complete program: it asserts what it shows


def test_the_markers_are_recognised() -> None:
    # A marker spelled wrong would make a fragment "runnable" and fail obscurely; a
    # comment right before a block must be one of the two markers.
    for block in ALL_BLOCKS:
        if block.marker.startswith("<!--"):
            assert _NOT_RUN.match(block.marker) or _RUN_SLOW.match(block.marker), block.name
