"""``agang doctor`` as a command: diagnose this process's job, print the findings, and
say by the exit status whether any is a problem.

Run the way the job runs (``torchrun --nproc-per-node=4 -m agang doctor``), every rank
runs the checks, but the job gets one report per node, not one per rank interleaved:

1. Each node's local rank 0 prints the whole report, headed (in text) by its host, its
   node and the ranks it speaks for. The ranks of a node share its host, its torch and
   its network, and under a launcher its variables but their own rank, so their reports
   would repeat it.
2. Every other rank prints only the problems that are its own: a launcher variable of
   its own (RANK, LOCAL_RANK, SLURM_PROCID, SLURM_LOCALID) that is wrong. It prints
   nothing when it has none. The ranks exchange nothing: the doctor runs before the
   network it checks is known to work.
3. A rank whose local rank cannot be read, and a process alone on its node (no launcher,
   a world of 1, one rank per node), prints the whole report, as every process once did.
4. The exit status is each rank's own, over all its findings, so the launcher's summary
   still names every rank that has a problem.

``agang/__main__.py`` imports this module only when the doctor runs: the host checks
load torch, which ``agang --help`` and the other commands must not wait for.
"""

from __future__ import annotations

import os
import re
import socket
import textwrap
from collections.abc import Mapping, Sequence
from typing import TextIO

from agang._cli.doctor.diagnose import diagnose
from agang._cli.doctor.findings import Finding, Status, has_problems, render, render_json
from agang._cli.doctor.host import HostFacts, probe_host_facts
from agang._cli.doctor.network import NetworkProbe, SocketProbe
from agang._errors import GangInitError
from agang._setup.env import WorldInfo, detect_launcher, world_from_env

# The variables that differ between the ranks of one node (rule 2), and each launcher's
# local rank and node number.
_OWN_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "SLURM_LOCALID")
_LOCAL_RANK = {"torchrun": "LOCAL_RANK", "slurm": "SLURM_LOCALID"}
_NODE = {"torchrun": "GROUP_RANK", "slurm": "SLURM_NODEID"}
_WIDTH = 100


def run_doctor(
    *,
    timeout: float,
    as_json: bool,
    out: TextIO,
    env: Mapping[str, str] | None = None,
    facts: HostFacts | None = None,
    network: NetworkProbe | None = None,
    host: str | None = None,
) -> int:
    """Runs the doctor's checks and writes this rank's part of the report to ``out``.

    Args:
        timeout: Seconds each network call may take.
        as_json: Write JSON instead of text.
        out: Where the report goes (standard output for the command).
        env: The environment to read; None for ``os.environ``.
        facts: This host's torch build and hardware; None to probe them.
        network: The network probe; None for a ``SocketProbe`` with ``timeout``.
        host: This host's name for the header; None for ``socket.gethostname()``.

    Returns:
        The exit status: 1 when one of this rank's findings is a problem, else 0.
    """
    env = os.environ if env is None else env
    findings = diagnose(
        env,
        probe_host_facts() if facts is None else facts,
        SocketProbe(timeout=timeout) if network is None else network,
    )
    out.write(report(findings, env, socket.gethostname() if host is None else host, as_json))
    return 1 if has_problems(findings) else 0


def report(findings: Sequence[Finding], env: Mapping[str, str], host: str, as_json: bool) -> str:
    """What this rank prints of ``findings``: all of them, or its own problems (rules 1-3)."""
    launcher = detect_launcher(env)
    local_rank = _int(env.get(_LOCAL_RANK[launcher.name])) if launcher is not None else None
    node = (
        f" (node {env[_NODE[launcher.name]]})" if launcher and _NODE[launcher.name] in env else ""
    )
    world = _world(env)
    if local_rank is None or local_rank == 0 or (world is not None and world.rank == 0):
        if as_json:
            return render_json(findings)
        header = _header(world, host, node)
        return (header + "\n" if header else "") + render(findings, width=_WIDTH)
    own = [finding for finding in findings if _is_own(finding)]
    if not own:
        return ""
    if as_json:
        return render_json(own)
    rank = f", rank {world.rank} of {world.world_size}" if world is not None else ""
    header = _wrap(
        f"agang doctor on {host}{node}, local rank {local_rank}{rank}: its own problems."
    )
    return header + "\n" + render(own, width=_WIDTH)


def _header(world: WorldInfo | None, host: str, node: str) -> str:
    if world is None or world.world_size == 1:
        return ""  # one process: nothing to tell apart
    where = f"agang doctor on {host}{node}, rank {world.rank} of {world.world_size}:"
    ranks = world.local_world_size
    if ranks is None:  # the launcher does not say
        return _wrap(f"{where} this rank's report.")
    if ranks == 1:
        return _wrap(f"{where} the report for this node, its one rank.")
    return _wrap(
        f"{where} the report for the {ranks} ranks on this node; the others print only "
        f"problems of their own."
    )


def _wrap(text: str) -> str:
    return textwrap.fill(text, _WIDTH, break_long_words=False, break_on_hyphens=False)


def _world(env: Mapping[str, str]) -> WorldInfo | None:
    # Where this rank sits, not where the store is: the node list needs no expanding.
    try:
        return world_from_env(env, expand_hostnames=lambda nodelist: [nodelist])
    except GangInitError:
        return None


def _is_own(finding: Finding) -> bool:
    """A problem with a variable that differs between the ranks of a node (rule 2)."""
    if finding.status is not Status.PROBLEM or finding.check != "world":
        return False
    named = re.search(r"`([A-Z_]+)`", finding.seen)
    return named is not None and named.group(1) in _OWN_VARIABLES


def _int(value: str | None) -> int | None:
    try:
        return None if value is None else int(value)
    except ValueError:
        return None
