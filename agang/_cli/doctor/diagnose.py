"""``agang doctor``: what ``agang.init`` would make of this process's job, and what fails.

A pure core: ``diagnose`` takes the environment, this host's torch facts
(``agang._cli.doctor.host.HostFacts``) and a network probe as arguments and
returns findings, so tests drive it with plain data. The backend and network checks live
in ``agang._cli.doctor.host`` and ``agang._cli.doctor.network``, the findings and their
rendering in ``agang._cli.doctor.findings``. The rules:

1. The world comes from ``agang._setup.env.world_from_env``, exactly as ``agang.init``
   reads it, so the doctor and init cannot disagree; an error it raises is a problem,
   with a fix chosen by the variable its message names.
2. Which launcher started the process, and which of its variables to show, comes from
   the launcher table init reads (``agang._setup.env.LAUNCHERS``): torchrun's
   variables win over SLURM's (as ``srun torchrun`` relies on), and SLURM is seen only
   with both SLURM_PROCID and SLURM_NTASKS, as init sees it. No launcher seen means an
   in-process gang, which is fine.
3. Several ranks on one node each size torch's thread pool to the whole node unless
   ``OMP_NUM_THREADS`` says otherwise, so an unset value with several local ranks is a
   warning that names the per-rank share (CPUs // local ranks, at least 1), and so is a
   value above the share. 1 is never above it: with more ranks than CPUs there is no
   smaller value to advise (torchrun sets 1).
4. A world of one rank uses no network: the network checks run only for a larger world.
5. Every warning and problem comes with the fix, and where there are several likely
   causes, with those too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from agang._cli.doctor.findings import Finding, Status
from agang._cli.doctor.host import HostFacts, backend_findings
from agang._cli.doctor.network import NetworkProbe, network_findings
from agang._errors import GangInitError
from agang._setup.env import (
    LAUNCHERS,
    TORCHRUN,
    Launcher,
    WorldInfo,
    detect_launcher,
    world_from_env,
)


def diagnose(env: Mapping[str, str], facts: HostFacts, network: NetworkProbe) -> list[Finding]:
    """Checks the launcher's variables, the backends and the rendezvous network.

    Args:
        env: The environment to read (``os.environ`` for the real thing).
        facts: This host's torch build and hardware.
        network: Resolves, binds and connects, each within a bounded time.

    Returns:
        The findings, launcher first, then backends, then network.

    Example:
        <!-- not-run: probes this machine and its network -->
        ```python
        findings = diagnose(os.environ, probe_host_facts(), SocketProbe(timeout=1.0))
        print(render(findings), end="")
        ```
    """
    world: WorldInfo | None = None
    findings = [_launcher_finding(env)]
    try:
        world = world_from_env(env)
    except GangInitError as exc:
        findings.append(_env_error_finding(str(exc)))
    else:
        world_finding = _world_finding(env, world)
        if world_finding is not None:
            findings.append(world_finding)
    if world is not None:
        findings += _local_findings(env, world, facts)
    findings += backend_findings(env, facts)
    if world is not None and world.world_size > 1:
        origin = _address_origin(env, world)
        findings += network_findings(world, network, address_origin=origin, env=env)
    return findings


# Launcher.


def _present(env: Mapping[str, str], launcher: Launcher) -> str:
    return ", ".join(f"{name}={env[name]}" for name in launcher.variables if name in env)


def _launcher_finding(env: Mapping[str, str]) -> Finding:
    launcher = detect_launcher(env)
    if launcher is not None:
        # Another launcher's variables beside it: it wins, by the table's order.
        others = [o for o in LAUNCHERS if o is not launcher and _present(env, o)]
        also = ""
        if launcher is TORCHRUN and others:
            owners = " and ".join(o.owner for o in others)
            also = f" (they take precedence over {owners}, as under `srun torchrun`)"
        return Finding(
            "launcher", Status.OK, f"{launcher.owner} variables{also}: {_present(env, launcher)}."
        )
    for seen in LAUNCHERS:
        if any(name in env for name in seen.markers):
            # Some of its markers, not enough: init sees no launcher, so neither does this.
            return Finding(
                "launcher",
                Status.OK,
                f"No launcher: {seen.owner} variables are set ({_present(env, seen)}), but "
                f"not {seen.describe_markers()}, so agang makes an in-process gang (a world "
                f"of 1).",
            )
    if "MASTER_ADDR" in env or "MASTER_PORT" in env:
        return Finding(
            "launcher",
            Status.WARN,
            f"{_present(env, TORCHRUN)} set, but neither `RANK` nor `WORLD_SIZE`: agang makes "
            f"an in-process gang (a world of 1).",
            causes=("the program was started directly instead of through torchrun",),
            fix="Start it with torchrun (or srun), or unset MASTER_ADDR/MASTER_PORT if one "
            "process is meant.",
        )
    return Finding(
        "launcher",
        Status.OK,
        "No launcher variables: agang makes an in-process gang (a world of 1, no network).",
    )


_TORCHRUN_FIX = (
    "Start the job with torchrun, which sets RANK, WORLD_SIZE and LOCAL_RANK for every "
    "process, or set them yourself with 0 <= RANK < WORLD_SIZE; unset both to run alone."
)
_LOCAL_FIX = (
    "Let torchrun set LOCAL_RANK and LOCAL_WORLD_SIZE (--nproc-per-node), or set them "
    "yourself with 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE."
)
_MASTER_FIX = (
    "Set MASTER_ADDR to the host of rank 0 and MASTER_PORT to a free port (1024-65535), "
    "the same on every rank; torchrun sets both from --master-addr and --master-port."
)
_SRUN_FIX = (
    "Start the program with srun inside the allocation, one task per rank, so that each "
    "task gets its own SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID."
)
_SLURM_JOB_FIX = (
    "Run it with srun inside a SLURM allocation (sbatch or salloc), or set MASTER_ADDR and "
    "MASTER_PORT yourself."
)
_FIXES = {
    "RANK": _TORCHRUN_FIX,
    "WORLD_SIZE": _TORCHRUN_FIX,
    "LOCAL_RANK": _LOCAL_FIX,
    "LOCAL_WORLD_SIZE": _LOCAL_FIX,
    "MASTER_ADDR": _MASTER_FIX,
    "MASTER_PORT": _MASTER_FIX,
    "SLURM_PROCID": _SRUN_FIX,
    "SLURM_NTASKS": _SRUN_FIX,
    "SLURM_LOCALID": _SRUN_FIX,
    "SLURM_NTASKS_PER_NODE": _SRUN_FIX,
    "SLURM_JOB_ID": _SLURM_JOB_FIX,
    "SLURM_JOB_NODELIST": _SLURM_JOB_FIX,
}


def _env_error_finding(message: str) -> Finding:
    named = re.search(r"`([A-Z_]+)`", message)
    fix = _FIXES.get(named.group(1) if named else "", "Correct or unset the variable named.")
    return Finding("world", Status.PROBLEM, message, fix=fix)


def _world_finding(env: Mapping[str, str], world: WorldInfo | None) -> Finding | None:
    if world is None:
        num_tasks = _int_or_none(env.get("SLURM_NTASKS"))
        if num_tasks is not None and num_tasks > 1:
            return Finding(
                "world",
                Status.PROBLEM,
                f"`SLURM_PROCID` must be set when `SLURM_NTASKS` is ({num_tasks}), but is "
                f"missing: this process is not one of srun's tasks, so it would run alone, "
                f"as a world of 1.",
                fix=_SRUN_FIX,
            )
        return None  # the launcher finding already says: an in-process gang
    if world.world_size == 1:
        return Finding("world", Status.OK, "A world of 1: an in-process gang, no network.")
    host = "the launcher's agent" if world.launcher_hosts_store else "rank 0"
    derived = ", port derived from SLURM_JOB_ID" if world.port_is_derived else ""
    return Finding(
        "world",
        Status.OK,
        f"Rank {world.rank} of {world.world_size} (local rank {world.local_rank}, from "
        f"{world.source}); the store at {world.store_address}{derived} is hosted by {host}.",
    )


def _address_origin(env: Mapping[str, str], world: WorldInfo) -> str:
    if world.source == "slurm" and not env.get("MASTER_ADDR"):
        return "the first host of SLURM_JOB_NODELIST"
    return ""


def _int_or_none(value: str | None) -> int | None:
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


def _local_findings(env: Mapping[str, str], world: WorldInfo, facts: HostFacts) -> list[Finding]:
    # world_from_env has already checked the local rank against the local world size.
    findings: list[Finding] = []
    local_size = world.local_world_size
    num_devices = facts.cuda_device_count
    if facts.cuda_available and num_devices and local_size and local_size > num_devices:
        findings.append(
            Finding(
                "local ranks",
                Status.PROBLEM,
                f"{local_size} ranks on this node share {num_devices} CUDA device(s): agang "
                f"gives each rank cuda:(local rank % {num_devices}), and NCCL refuses two "
                f"ranks of one communicator on the same device.",
                fix=f"Start at most {num_devices} ranks per node (torchrun "
                f"--nproc-per-node={num_devices}), or make more devices visible "
                f"(CUDA_VISIBLE_DEVICES).",
            )
        )
    findings.append(_threads_finding(env, local_size, facts.num_cpus))
    return findings


def _threads_finding(
    env: Mapping[str, str], local_size: int | None, num_cpus: int | None
) -> Finding:
    value = env.get("OMP_NUM_THREADS")
    ranks = local_size or 1  # unknown: judge this rank alone
    share = max(1, num_cpus // ranks) if num_cpus else None
    share_text = f" ({num_cpus} CPUs // {ranks} ranks = {share})" if share else ""
    if value is not None:
        threads = _int_or_none(value)
        if threads is None or threads < 1:
            return Finding(
                "threads",
                Status.PROBLEM,
                f"`OMP_NUM_THREADS` must be a positive integer, but is {value!r} instead.",
                fix=f"Set it to each rank's share of this node's CPUs{share_text}, or unset it.",
            )
        if share and threads > share:
            return Finding(
                "threads",
                Status.WARN,
                f"OMP_NUM_THREADS={threads} with {ranks} ranks on this node asks for "
                f"{threads * ranks} compute threads on {num_cpus} CPUs.",
                causes=("the ranks' thread pools compete for the same cores",),
                fix=f"Set OMP_NUM_THREADS to each rank's share{share_text}.",
            )
        if num_cpus and ranks > num_cpus:  # one thread each, and still more than the CPUs
            return Finding(
                "threads",
                Status.OK,
                f"OMP_NUM_THREADS=1 per rank, the fewest: the {ranks} ranks on this node "
                f"outnumber its {num_cpus} CPUs by themselves.",
            )
        return Finding("threads", Status.OK, f"OMP_NUM_THREADS={threads} per rank.")
    if ranks > 1:
        pool = f"all {num_cpus} CPUs" if num_cpus else "every CPU"
        return Finding(
            "threads",
            Status.WARN,
            f"`OMP_NUM_THREADS` is unset with {ranks} ranks on this node: each rank sizes "
            f"torch's thread pool to {pool}, so the ranks oversubscribe the cores and slow "
            f"each other down, their communication threads included.",
            fix=f"Set OMP_NUM_THREADS to each rank's share{share_text}; torchrun sets 1 "
            f"unless it is already set.",
        )
    if local_size is None:
        return Finding(
            "threads",
            Status.OK,
            "OMP_NUM_THREADS is unset; the launcher does not say how many ranks share this "
            "node (torchrun's LOCAL_WORLD_SIZE).",
        )
    return Finding("threads", Status.OK, "OMP_NUM_THREADS is unset; one rank on this node.")
