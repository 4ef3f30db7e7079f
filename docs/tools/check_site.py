"""Checks the built docs site (site/**/*.html) for defects that `mkdocs build --strict` passes.

    python .ci/check_site.py [SITE_DIR]     # default: site

It fails (exit 1), listing each defect with its page, on:

- a leaked Sphinx role: ``:func:``, ``:class:``, ``:meth:``... in the text of a page,
  where a docstring used reStructuredText that Markdown shows as it is written (code
  blocks are not searched: a page may show a role on purpose there);
- an example rendered as a quote: a ``>>>`` prompt in prose, or a blockquote inside an
  API entry (Markdown reads a docstring's ``>>>`` lines as nested quotes, and shows the
  code as grey prose with its lines joined);
- an attribute documented twice on one object: an ``Attributes:`` table row that links
  to a heading of its own on the same page (the entry's member list documents it too),
  or one heading id used twice on a page.

It needs only the standard library. ``tests/unit/test_check_site.py`` feeds it a small
page with each defect, and a clean one.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|attr|exc|mod|data|obj|const|ref|doc|term):`?")
PROMPT = re.compile(r"(?:^|\s)>>>(?:\s|$)")
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
        "track", "wbr"}  # fmt: skip
CODE = {"pre", "code", "script", "style", "textarea"}
HEADINGS = {"h1", "h2", "h3", "h4", "h5", "h6"}

KINDS = ("role", "quoted-example", "duplicate-attribute")


@dataclass(frozen=True)
class Defect:
    page: str
    kind: str  # one of KINDS
    detail: str

    def __str__(self) -> str:
        return f"{self.page}: {self.kind}: {self.detail}"


class _Page(HTMLParser):
    def __init__(self, page: str) -> None:
        super().__init__(convert_charrefs=True)
        self.page = page
        self.defects: list[Defect] = []
        self.stack: list[tuple[str, set[str]]] = []  # open elements: tag, classes
        self.heading_ids: list[str] = []
        self.table_refs: list[tuple[str, str]] = []  # (owner, target) of "Attributes:" names
        self.table_owner = ""  # the entry whose "Attributes:" table is open
        self.cell = 0  # which cell of the table's row is open (1: the name)
        self.section_title: list[str] | None = None  # text of a doc-section-title, as read
        self.attributes_next = False  # the next table is an "Attributes:" section's
        self.attributes_depth: int | None = None  # stack depth of that table, while open

    def _inside(self, tags: set[str]) -> bool:
        return any(tag in tags for tag, _ in self.stack)

    def _in_class(self, cls: str) -> bool:
        return any(cls in classes for _, classes in self.stack)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        classes = set((values.get("class") or "").split())
        if tag == "blockquote" and not self._inside({"blockquote"}) and self._in_class("doc"):
            self.defects.append(
                Defect(self.page, "quoted-example", f"a blockquote in the entry {self._entry()}")
            )
        if tag in HEADINGS and values.get("id"):
            self.heading_ids.append(values["id"] or "")
        if tag == "span" and "doc-section-title" in classes:
            self.section_title = []
        if tag == "table" and self.attributes_next:
            self.attributes_next = False
            self.attributes_depth = len(self.stack)
            self.table_owner = self._entry()
        if tag == "tr":
            self.cell = 0
        if tag == "td":
            self.cell += 1
        href = values.get("href") or ""
        in_name_cell = self.attributes_depth is not None and self.cell == 1
        if tag == "a" and in_name_cell and href.startswith("#"):
            self.table_refs.append((self.table_owner, href[1:]))
        if tag not in VOID:
            self.stack.append((tag, classes))

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID:
            return
        # Pop to the matching element (browsers forgive unclosed <p>, <li>...; so do we).
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                del self.stack[i:]
                break
        if self.attributes_depth is not None and len(self.stack) <= self.attributes_depth:
            self.attributes_depth = None
        if tag == "span" and self.section_title is not None:
            title = "".join(self.section_title).strip()
            self.attributes_next = title.startswith("Attributes")
            self.section_title = None

    def handle_data(self, data: str) -> None:
        if self.section_title is not None:
            self.section_title.append(data)
        if self._inside(CODE):
            return
        for match in ROLE.finditer(data):
            context = " ".join(data[max(0, match.start() - 30) : match.end() + 30].split())
            self.defects.append(Defect(self.page, "role", f"{match.group()} in '{context}'"))
        if PROMPT.search(data):
            context = " ".join(data.split())[:60]
            self.defects.append(Defect(self.page, "quoted-example", f">>> in prose: '{context}'"))

    def _entry(self) -> str:
        return self.heading_ids[-1] if self.heading_ids else "(top)"

    def finish(self) -> list[Defect]:
        self.close()
        ids = set(self.heading_ids)
        for owner, ref in self.table_refs:
            # A row naming an attribute of this very entry that has its own entry too (a
            # row may link elsewhere: an inherited attribute documented on its base class).
            if ref in ids and ref.rpartition(".")[0] == owner:
                self.defects.append(
                    Defect(
                        self.page,
                        "duplicate-attribute",
                        f"{ref} is in an Attributes: table and has its own entry",
                    )
                )
        for heading, count in Counter(self.heading_ids).items():
            if count > 1:
                self.defects.append(
                    Defect(self.page, "duplicate-attribute", f"heading id {heading} x{count}")
                )
        return self.defects


def check_html(html: str, page: str = "<page>") -> list[Defect]:
    """The defects of one page's HTML."""
    parser = _Page(page)
    parser.feed(html)
    return parser.finish()


def check_site(site: Path) -> list[Defect]:
    """The defects of every page under ``site``."""
    defects: list[Defect] = []
    for path in sorted(site.rglob("*.html")):
        defects += check_html(path.read_text(encoding="utf-8"), str(path.relative_to(site)))
    return defects


def main(argv: list[str]) -> int:
    site = Path(argv[1] if len(argv) > 1 else "site")
    pages = sorted(site.rglob("*.html"))
    if not pages:
        print(f"check_site: no HTML under {site}/: build the site first", file=sys.stderr)
        return 2
    defects = check_site(site)
    for defect in defects:
        print(defect)
    counts = Counter(d.kind for d in defects)
    summary = ", ".join(f"{kind} {counts[kind]}" for kind in KINDS)
    print(f"check_site: {len(pages)} pages; {summary}")
    return 1 if defects else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
