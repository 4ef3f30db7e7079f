"""What ``agang doctor`` reports: findings, and their rendering as text or JSON."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum


class Status(StrEnum):
    """How a check came out."""

    OK = "ok"
    WARN = "warn"
    PROBLEM = "problem"


@dataclass(frozen=True)
class Finding:
    """One check's outcome.

    Attributes:
        check: What was checked, e.g. ``"launcher"`` or ``"MASTER_PORT"``.
        status: ok, warn or problem.
        seen: What the check saw, as a sentence.
        causes: The likely causes of a warning or problem, most likely first.
        fix: What to do about a warning or problem; empty when ok.
    """

    check: str
    status: Status
    seen: str
    causes: tuple[str, ...] = ()
    fix: str = ""


def has_problems(findings: Sequence[Finding]) -> bool:
    """Whether any finding is a problem (the doctor's exit status is then 1)."""
    return any(finding.status is Status.PROBLEM for finding in findings)


_LABELS = {Status.OK: "ok", Status.WARN: "warn", Status.PROBLEM: "PROBLEM"}


def render(findings: Sequence[Finding], *, width: int = 100) -> str:
    """A readable diagnosis: one block per finding, then a summary line.

    Args:
        findings: What ``agang._cli.doctor.diagnose.diagnose`` returned.
        width: The column to wrap at.

    Returns:
        The text, ending with a newline.
    """
    lines: list[str] = []
    indent = " " * 9

    def wrap(text: str, first: str, rest: str) -> list[str]:
        # Options such as --nproc-per-node=4 and addresses stay whole.
        return textwrap.wrap(
            text,
            width,
            initial_indent=first,
            subsequent_indent=rest,
            break_long_words=False,
            break_on_hyphens=False,
        )

    for finding in findings:
        lines += wrap(f"{_LABELS[finding.status]:<8} {finding.check}: {finding.seen}", "", indent)
        if finding.causes:
            lines.append(f"{indent}likely causes:")
            for cause in finding.causes:
                lines += wrap(cause, indent + "- ", indent + "  ")
        if finding.fix:
            lines += wrap(f"fix: {finding.fix}", indent, indent)
    lines += ["", _summary(findings)]
    return "\n".join(lines) + "\n"


def render_json(findings: Sequence[Finding]) -> str:
    """The findings as a JSON document: ``{"problems": n, "warnings": n, "findings": [...]}``."""
    counts = {status: sum(f.status is status for f in findings) for status in Status}
    document = {
        "problems": counts[Status.PROBLEM],
        "warnings": counts[Status.WARN],
        "findings": [asdict(finding) for finding in findings],
    }
    return json.dumps(document, indent=2) + "\n"


def _summary(findings: Sequence[Finding]) -> str:
    problems = sum(f.status is Status.PROBLEM for f in findings)
    warnings = sum(f.status is Status.WARN for f in findings)
    if not problems and not warnings:
        return "No problems found."
    parts = [f"{problems} problem{'s' * (problems != 1)}"] if problems else []
    parts += [f"{warnings} warning{'s' * (warnings != 1)}"] if warnings else []
    return f"Found {' and '.join(parts)}."
