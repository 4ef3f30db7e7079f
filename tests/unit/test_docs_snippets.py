"""The Python blocks of the docs (docs/**/*.md), of README.md and of agang's docstrings
cannot rot.

The docstrings' ``Example:`` sections hold ```python blocks too (mkdocstrings renders them
as code in the API reference; a ``>>>`` prompt there would render as a quote), and follow
the same rules. Every ```python block is one of three kinds, told apart by the line
before it:

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
SOURCE_FILES = sorted((ROOT / "agang").rglob("*.py"))

_FENCE = re.compile(r"^(?P<indent>\s*)```python\s*$")
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
    """Every ```python block of ``path``, with the nearest non-blank line above it.

    A block in a docstring is indented: its code is taken without the fence's indent.
    """
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        if fence := _FENCE.match(lines[i]):
            indent = len(fence["indent"])
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            assert j < len(lines), f"{path}:{i + 1}: unclosed ```python block"
            k = i - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            marker = lines[k].strip() if k >= 0 else ""
            code = "\n".join(line[indent:] for line in lines[i + 1 : j]) + "\n"
            blocks.append(Block(path, i + 1, code, marker))
            i = j
        i += 1
    return blocks


DOC_BLOCKS = [b for f in DOC_FILES for b in python_blocks(f)]
DOCSTRING_BLOCKS = [b for f in SOURCE_FILES for b in python_blocks(f)]
ALL_BLOCKS = DOC_BLOCKS + DOCSTRING_BLOCKS


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
    kinds = {_kind(b) for b in DOC_BLOCKS}
    assert kinds == {"run", "include", "not-run"}, kinds
    assert {_kind(b) for b in DOCSTRING_BLOCKS} == {"run", "not-run"}


def test_fragments_that_are_not_run_are_few_and_say_why() -> None:
    fragments = [b for b in ALL_BLOCKS if _kind(b) == "not-run"]
    for block in fragments:
        match = _NOT_RUN.match(block.marker)
        assert match, block.name
        assert len(match["reason"]) >= 10, f"{block.name}: give the reason"
    # Most blocks of the docs run: an illustrative fragment is the exception.
    doc_fragments = [b for b in DOC_BLOCKS if _kind(b) == "not-run"]
    assert len(doc_fragments) * 3 <= len(DOC_BLOCKS), [b.name for b in doc_fragments]
    # A docstring example shows one call, yet most still run as a whole program on
    # FakeWorld; those that need a launcher, a store or GPUs are not run.
    api_fragments = [b for b in DOCSTRING_BLOCKS if _kind(b) == "not-run"]
    assert len(api_fragments) * 2 <= len(DOCSTRING_BLOCKS), [b.name for b in api_fragments]


_PROMPT = re.compile(r"^\s*>>>( |$)", re.MULTILINE)
_RST_CODE = re.compile(r"^\s*Examples?::\s*$", re.MULTILINE)


@pytest.mark.parametrize("path", SOURCE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_docstring_example_is_a_python_block(path: Path) -> None:
    # mkdocstrings (Google style) reads `>>>` lines as nested Markdown quotes and an
    # `Example::` literal block as prose: the reference would show the code as grey text.
    text = path.read_text(encoding="utf-8")
    assert not _PROMPT.search(text), f"{path}: a >>> prompt; use a ```python block"
    assert not _RST_CODE.search(text), f"{path}: an `Example::` block; use ```python"


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


_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|attr|exc|mod|data|obj|const):`")


@pytest.mark.parametrize("path", SOURCE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_docstring_cross_reference_is_markdown(path: Path) -> None:
    # A Sphinx role shows as literal text on the site. A name of the reference is a link,
    # [`init`][agang.init] (mkdocs build --strict fails if it does not resolve); any other
    # name, a private one included, is plain ``code``.
    match = _ROLE.search(path.read_text(encoding="utf-8"))
    assert not match, f"{path}: a Sphinx role {match.group()!r}; write [`name`][agang.name]"
