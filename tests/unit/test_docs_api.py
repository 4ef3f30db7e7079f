"""The API reference (docs/api/*.md) documents every public name, and each has a docstring.

mkdocstrings renders a ``::: agang.Name`` entry from the name's docstring (and lists
undocumented members too: ``show_if_no_docstring`` in mkdocs.yml). This test needs no
MkDocs: it fails when a name in ``agang.__all__`` or ``agang.testing.__all__`` has no
docstring of its own, or no entry on an API page, so a new public name cannot ship
without its reference.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from types import ModuleType

import pytest

import agang
import agang.ray
import agang.testing

ROOT = Path(__file__).resolve().parents[2]
API_DIR = ROOT / "docs" / "api"
_ENTRY = re.compile(r"^:::\s+(?P<path>[\w.]+)\s*$", re.MULTILINE)

PUBLIC = (
    [(agang, name) for name in agang.__all__]
    + [(agang.ray, name) for name in agang.ray.__all__]
    + [(agang.testing, name) for name in agang.testing.__all__]
)


def documented_paths(api_dir: Path = API_DIR) -> set[str]:
    """Every ``::: dotted.path`` entry on the API pages."""
    return {m["path"] for page in api_dir.glob("*.md") for m in _ENTRY.finditer(page.read_text())}


def own_docstring(obj: object) -> str | None:
    """The object's own docstring: not one inherited from a base class or from its type."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    return doc.strip() if isinstance(doc, str) and doc.strip() else None


def _id(item: tuple[ModuleType, str]) -> str:
    return f"{item[0].__name__}.{item[1]}"


@pytest.mark.parametrize("item", PUBLIC, ids=_id)
def test_a_public_name_has_a_docstring_of_its_own(item: tuple[ModuleType, str]) -> None:
    module, name = item
    assert own_docstring(getattr(module, name)), f"{module.__name__}.{name} has no docstring"


@pytest.mark.parametrize("item", PUBLIC, ids=_id)
def test_a_public_name_has_an_api_entry(item: tuple[ModuleType, str]) -> None:
    module, name = item
    path = f"{module.__name__}.{name}"
    assert path in documented_paths(), f"no '::: {path}' on any page of docs/api/"


def test_every_api_entry_names_a_public_name() -> None:
    # An entry for a name that is gone (or private) would fail mkdocs build --strict; say so
    # here too, where it is quicker to see.
    public = {_id(item) for item in PUBLIC}
    assert documented_paths() - public == set()


def test_the_api_pages_are_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in sorted(API_DIR.glob("*.md")):
        assert f"api/{page.name}" in nav, page.name


def linked_pages(index: Path = API_DIR / "index.md") -> set[str]:
    """The pages of docs/api/ that the API index links to."""
    return set(re.findall(r"\]\(([\w-]+\.md)(?:#[\w-]*)?\)", index.read_text()))


def test_every_api_page_is_linked_from_the_api_index() -> None:
    # The index is where a reader finds a name's page: a page it does not list is found
    # only through the navigation (the weights page was).
    pages = {page.name for page in API_DIR.glob("*.md")} - {"index.md"}
    assert pages - linked_pages() == set()


def test_the_checks_see_a_missing_docstring_and_a_missing_entry(tmp_path: Path) -> None:
    class Undocumented:
        pass

    class Documented(Undocumented):
        """Has one."""

    class Inherits(Documented):
        pass

    assert own_docstring(Documented) == "Has one."
    assert own_docstring(Undocumented) is None
    assert own_docstring(Inherits) is None  # inspect.getdoc would find the parent's
    (tmp_path / "page.md").write_text("# Page\n\n::: agang.init\n\n`::: agang.Gang` in text\n")
    assert documented_paths(tmp_path) == {"agang.init"}
    (tmp_path / "index.md").write_text("| [Gangs](gangs.md) | [w](weights.md#top) | `x.md` |\n")
    assert linked_pages(tmp_path / "index.md") == {"gangs.md", "weights.md"}


def public_members(obj: object) -> list[str]:
    """A public class's own public methods and properties (what its API entry lists)."""
    if not inspect.isclass(obj):
        return []
    members = []
    for name, value in vars(obj).items():
        if name.startswith("_"):
            continue
        if isinstance(value, staticmethod | classmethod):
            value = value.__func__
        if isinstance(value, property) or inspect.isfunction(value):
            members.append(name)
    return members


@pytest.mark.parametrize("item", PUBLIC, ids=_id)
def test_a_public_classs_methods_and_properties_have_docstrings(
    item: tuple[ModuleType, str],
) -> None:
    module, name = item
    cls = getattr(module, name)
    bare = []
    for member in public_members(cls):
        value = vars(cls)[member]
        if isinstance(value, staticmethod | classmethod):
            value = value.__func__
        doc = value.fget.__doc__ if isinstance(value, property) else value.__doc__
        if not (isinstance(doc, str) and doc.strip()):
            bare.append(member)
    assert not bare, f"{module.__name__}.{name}: no docstring on {', '.join(bare)}"
