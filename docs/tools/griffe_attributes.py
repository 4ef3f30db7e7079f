"""A griffe extension for the API reference: each attribute documented once, in its entry.

agang's classes describe their attributes the Google way, in an ``Attributes:`` section
of the class docstring (``help()`` shows them there). mkdocstrings renders that section
as a table, and also lists each attribute as a member entry of its own (an undocumented
member is listed too: ``show_if_no_docstring``), so the reference showed every attribute
twice, the second time as its bare assignment (``attempts = attempts``).

This extension, loaded by mkdocstrings (mkdocs.yml), moves each description from the
section to the attribute's own entry when the attribute has no docstring of its own,
drops the moved items from the section (an inherited attribute stays there), and hides
the value of an attribute assigned in ``__init__`` (``self.attempts = attempts``: the
value is only the argument's name). A class-level value (a dataclass field's default) is
kept. The docstrings in agang/ are not changed.
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Docstring, DocstringSectionKind, Extension, Object

_HEADER = re.compile(r"^Attributes:\s*$")
_ITEM = re.compile(r"^(?P<indent>\s+)(?P<name>[\w*]+)\s*(\([^)]*\))?:")


def _without_items(text: str, names: set[str]) -> str:
    """``text`` without the ``Attributes:`` items named (each with its indented lines), and
    without the section's header once no item is left."""
    lines = text.splitlines()
    kept: list[str] = []
    header: int | None = None  # where the section's header is in ``kept``
    in_section = dropping = False
    items_left = 0
    for line in lines:
        if _HEADER.match(line):
            in_section, header = True, len(kept)
            kept.append(line)
            continue
        if in_section and line.strip() and not line[:1].isspace():
            in_section = dropping = False  # the next section
        if in_section and (item := _ITEM.match(line)) and len(item["indent"]) <= 4:
            dropping = item["name"] in names
            items_left += not dropping
        if not (in_section and dropping):
            kept.append(line)
    if header is not None and not items_left:
        del kept[header]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(kept)).strip()


def _members_named(obj: Object, name: str) -> list[Object]:
    """The members ``name`` stands for: one, or all those it matches (``latency_*``)."""
    prefix = name.removesuffix("*")
    return [
        member
        for key, member in obj.members.items()
        if (key.startswith(prefix) if name.endswith("*") else key == name)
        and isinstance(member, Object)
    ]


class AttributesOnce(Extension):
    """Moves a class docstring's ``Attributes:`` descriptions to the attributes' entries."""

    def on_object(self, *, obj: Object, **kwargs: Any) -> None:
        if not obj.is_class:
            return
        for member in obj.members.values():
            if not member.is_alias and "instance-attribute" in member.labels:
                member.value = None  # type: ignore[union-attr]
        docstring = obj.docstring
        if docstring is None:
            return
        sections = [
            s for s in docstring.parse("google") if s.kind is DocstringSectionKind.attributes
        ]
        moved: set[str] = set()
        for section in sections:
            for item in section.value:
                members = _members_named(obj, item.name)
                for member in members:
                    if member.docstring is None:
                        member.docstring = Docstring(
                            item.description, parent=member, lineno=docstring.lineno
                        )
                if members:
                    moved.add(item.name)
        # An item that names no member of its own (an inherited attribute) stays.
        if moved:
            obj.docstring = Docstring(
                _without_items(docstring.value, moved),
                lineno=docstring.lineno,
                endlineno=docstring.endlineno,
                parent=obj,
                parser=docstring.parser,
                parser_options=docstring.parser_options,
            )
