"""``agang doctor`` as a command: diagnose this process's job, print the findings, and
say by the exit status whether any is a problem.

``agang/__main__.py`` imports this module only when the doctor runs: the host checks
load torch, which ``agang --help`` and the other commands must not wait for.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TextIO

from agang._cli.doctor.diagnose import diagnose
from agang._cli.doctor.findings import has_problems, render, render_json
from agang._cli.doctor.host import probe_host_facts
from agang._cli.doctor.network import SocketProbe


def run_doctor(
    *, timeout: float, as_json: bool, out: TextIO, env: Mapping[str, str] | None = None
) -> int:
    """Runs the doctor's checks and writes the report to ``out``.

    Args:
        timeout: Seconds each network call may take.
        as_json: Write JSON instead of text.
        out: Where the report goes (standard output for the command).
        env: The environment to read; None for ``os.environ``.

    Returns:
        The exit status: 1 when a finding is a problem, else 0.
    """
    findings = diagnose(
        os.environ if env is None else env, probe_host_facts(), SocketProbe(timeout=timeout)
    )
    out.write(render_json(findings) if as_json else render(findings))
    return 1 if has_problems(findings) else 0
