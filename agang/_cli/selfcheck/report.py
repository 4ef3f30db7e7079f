"""The self-check's results: one row per check, merged across ranks, as a table."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Result = Literal["PASS", "FAIL", "SKIP"]


@dataclass(frozen=True)
class Row:
    """One check's outcome on one rank.

    Attributes:
        check: The check's name.
        result: PASS, FAIL, or SKIP (not applicable here; never a failure).
        figure: What was measured, or why it failed or was skipped.
    """

    check: str
    result: Result
    figure: str


def merge(per_rank: Sequence[Sequence[Row]]) -> list[Row]:
    """One row per check: FAIL if it failed on any rank (naming the ranks), else the
    first rank's row (rank 0 prints the table)."""
    merged = []
    for position, row in enumerate(per_rank[0]):
        failed = [
            (rank, rows[position])
            for rank, rows in enumerate(per_rank)
            if rows[position].result == "FAIL"
        ]
        if failed and len(per_rank) > 1:
            ranks = ", ".join(str(rank) for rank, _ in failed)
            row = Row(row.check, "FAIL", f"rank {ranks}: {failed[0][1].figure}")
        elif failed:
            row = failed[0][1]
        merged.append(row)
    return merged


def passed(rows: Sequence[Row]) -> bool:
    """Whether no check failed (and at least one ran)."""
    return any(r.result == "PASS" for r in rows) and all(r.result != "FAIL" for r in rows)


def render(title: str, rows: Sequence[Row]) -> str:
    """The table a user reads, ending with the verdict."""
    width = max([len("check"), *(len(r.check) for r in rows)])
    lines = [title, "", f"{'check':<{width}}  result  figure"]
    lines += [f"{r.check:<{width}}  {r.result:<6}  {r.figure}" for r in rows]
    failed = [r.check for r in rows if r.result == "FAIL"]
    ran = [r for r in rows if r.result != "SKIP"]
    lines.append("")
    if failed:
        lines.append(f"FAILED: {len(failed)} of {len(ran)} checks ({', '.join(failed)})")
    else:
        lines.append(f"all {len(ran)} checks passed")
    return "\n".join(lines) + "\n"
