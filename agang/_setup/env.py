"""The world a process belongs to, read from its launcher's environment.

The launchers agang knows are one table, ``LAUNCHERS``, in the order they are tried:
each with its name, the variables that show it started this process, every variable it
reads, and the function that reads them. ``agang doctor`` reads the same table, so it
cannot see a launcher where ``agang.init`` sees none, or the other way round.

1. torchrun's contract: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
   MASTER_PORT (and TORCHELASTIC_USE_AGENT_STORE when torchrun's agent, or ``agang
   store``, hosts the store). Seen when RANK *or* WORLD_SIZE is set: one without the
   other is a half-made launch, and fails naming the missing one.
2. SLURM's, for ``srun``-launched jobs: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
   SLURM_NTASKS_PER_NODE, SLURM_JOB_NODELIST and SLURM_JOB_ID. The first host of the node
   list is the store host (expanded by ``scontrol show hostnames`` when that is
   installed, else by agang's own parser), and the port is derived from the job id, so
   every rank of the job agrees without talking. MASTER_ADDR/MASTER_PORT, when set,
   win over the derived values. Seen only when SLURM_PROCID *and* SLURM_NTASKS are set:
   a process inside an allocation that srun did not start (from ``salloc``'s shell,
   say) can see the job's SLURM_NTASKS without a SLURM_PROCID of its own; it is one
   process, not a rank of a world whose other ranks would never come, and SLURM_PROCID
   alone gives no world size.
3. None of them: no world (the caller decides: explicit arguments, or an in-process gang).
The mapping is injectable, so all of this is tested with plain dicts, and so is the
``scontrol`` runner.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from agang._errors import GangInitError

# Ports derived from a SLURM job id fall in [BASE, BASE + SPAN): below Linux's ephemeral
# range (32768 and up), so they do not collide with outgoing connections.
SLURM_PORT_BASE = 10000
SLURM_PORT_SPAN = 20000

HostnameExpander = Callable[[str], list[str]]


@dataclass(frozen=True)
class WorldInfo:
    """Where this process sits in its job, and where the rendezvous store lives.

    Example:
        <!-- not-run: agang.init joins the world a launcher (torchrun) set up -->
        ```python
        world = WorldInfo(rank=0, world_size=2, local_rank=0, master_addr="127.0.0.1",
                          master_port=29500)
        gang = await agang.init(world=world)
        ```
    """

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    #: True when the launcher (torchrun's agent) already hosts the store.
    launcher_hosts_store: bool = False
    #: Where the values came from: "torchrun", "slurm" or "arguments".
    source: str = "arguments"
    #: Ranks on this machine, or None when the launcher did not say.
    local_world_size: int | None = None
    #: True when agang chose the port (SLURM): it may then move to a free one nearby.
    port_is_derived: bool = False
    #: Identifies this launch among others that might reach the same store port.
    job_id: str = ""

    @property
    def store_address(self) -> str:
        """The store's ``HOST:PORT`` (``MASTER_ADDR`` and ``MASTER_PORT``)."""
        return f"{self.master_addr}:{self.master_port}"


def _int(env: Mapping[str, str], name: str, *, minimum: int) -> int:
    value = env[name]
    try:
        number = int(value)
    except ValueError:
        raise GangInitError(f"`{name}` must be an integer, but is {value!r} instead.") from None
    if number < minimum:
        raise GangInitError(
            f"`{name}` must be greater than or equal to {minimum}, but is {number} instead."
        )
    return number


def _port(env: Mapping[str, str], name: str = "MASTER_PORT") -> int:
    port = _int(env, name, minimum=0)
    if port > 65535:
        raise GangInitError(f"`{name}` must be at most 65535, but is {port} instead.")
    return port


def _check_rank(rank: int, world_size: int, rank_name: str, size_name: str) -> None:
    if rank >= world_size:
        raise GangInitError(
            f"`{rank_name}` must be less than `{size_name}` ({world_size}), but is {rank} instead."
        )


def world_from_env(
    env: Mapping[str, str], *, expand_hostnames: HostnameExpander | None = None
) -> WorldInfo | None:
    """Reads torchrun's variables, else SLURM's; None when neither launcher is seen.

    Args:
        env: The environment, e.g. ``os.environ``.
        expand_hostnames: Turns a SLURM node list into host names; by default
            ``scontrol show hostnames`` if installed, else agang's own parser.

    Raises:
        GangInitError: A variable is set but invalid (not an integer, a rank not below the
            world size, one of a required pair missing); the message names it and its value.
    """
    launcher = detect_launcher(env)
    if launcher is None:
        return None
    return launcher.read(env, expand_hostnames or expand_nodelist)


def detect_launcher(env: Mapping[str, str]) -> Launcher | None:
    """The first launcher of ``LAUNCHERS`` that ``env`` shows; None when none does."""
    return next((launcher for launcher in LAUNCHERS if launcher.detects(env)), None)


def _torchrun_world(env: Mapping[str, str], _expand_hostnames: HostnameExpander) -> WorldInfo:
    for present, missing in (("RANK", "WORLD_SIZE"), ("WORLD_SIZE", "RANK")):
        if present in env and missing not in env:
            raise GangInitError(
                f"`{missing}` must be set when `{present}` is, but is missing; start the "
                f"job with torchrun or set both."
            )
    world_size = _int(env, "WORLD_SIZE", minimum=1)
    rank = _int(env, "RANK", minimum=0)
    _check_rank(rank, world_size, "RANK", "WORLD_SIZE")
    local_rank = _int(env, "LOCAL_RANK", minimum=0) if "LOCAL_RANK" in env else rank
    local_world_size = None
    if "LOCAL_WORLD_SIZE" in env:
        local_world_size = _int(env, "LOCAL_WORLD_SIZE", minimum=1)
        _check_rank(local_rank, local_world_size, "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    if world_size > 1:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not env.get(name):
                raise GangInitError(
                    f"`{name}` must be set for a world of size {world_size}, but is missing."
                )
    return WorldInfo(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        master_addr=env.get("MASTER_ADDR") or "127.0.0.1",
        master_port=_port(env) if env.get("MASTER_PORT") else 0,
        launcher_hosts_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() in ("1", "true"),
        source="torchrun",
        local_world_size=local_world_size,
        job_id=env.get("TORCHELASTIC_RUN_ID", ""),
    )


def _slurm_world(env: Mapping[str, str], expand_hostnames: HostnameExpander) -> WorldInfo:
    world_size = _int(env, "SLURM_NTASKS", minimum=1)
    rank = _int(env, "SLURM_PROCID", minimum=0)
    _check_rank(rank, world_size, "SLURM_PROCID", "SLURM_NTASKS")
    local_rank = _int(env, "SLURM_LOCALID", minimum=0) if "SLURM_LOCALID" in env else 0
    local_world_size = _slurm_tasks_per_node(env)
    if local_world_size is not None:
        _check_rank(local_rank, local_world_size, "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE")
    job_id = env.get("SLURM_JOB_ID", "")
    if env.get("MASTER_PORT"):
        port, derived = _port(env), False
    elif world_size == 1:
        port, derived = 0, False
    else:
        if not job_id.isdigit():
            raise GangInitError(
                f"`SLURM_JOB_ID` must be an integer to derive the store port from, but is "
                f"{job_id!r} instead; or set MASTER_PORT."
            )
        port, derived = SLURM_PORT_BASE + int(job_id) % SLURM_PORT_SPAN, True
    if env.get("MASTER_ADDR"):
        address = env["MASTER_ADDR"]
    elif world_size == 1:
        address = "127.0.0.1"
    else:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
        if not nodelist:
            raise GangInitError(
                "`SLURM_JOB_NODELIST` must be set to find the store host, but is missing; "
                "or set MASTER_ADDR."
            )
        hosts = expand_hostnames(nodelist)
        if not hosts:
            raise GangInitError(
                f"`SLURM_JOB_NODELIST` must name at least one host, but is {nodelist!r} instead."
            )
        address = hosts[0]
    return WorldInfo(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        master_addr=address,
        master_port=port,
        source="slurm",
        local_world_size=local_world_size,
        port_is_derived=derived,
        job_id=job_id,
    )


def _slurm_tasks_per_node(env: Mapping[str, str]) -> int | None:
    value = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not value:
        return None
    # SLURM_TASKS_PER_NODE reads like "4(x2),3": the first node's count is ours when
    # they are all equal, which is the only layout local ranks make sense for.
    first = re.match(r"(\d+)", value)
    if first is None or int(first.group(1)) < 1:
        raise GangInitError(
            f"`SLURM_NTASKS_PER_NODE` must be a positive integer, but is {value!r} instead."
        )
    return int(first.group(1))


@dataclass(frozen=True)
class Launcher:
    """A launcher agang reads the world from: one row of ``LAUNCHERS``."""

    #: Its name, as [`WorldInfo.source`][agang.WorldInfo.source] gives it.
    name: str
    #: How messages name it ("torchrun's variables").
    owner: str
    #: The variables that show it started this process.
    markers: tuple[str, ...]
    #: True: every marker must be set; False: any one is enough.
    needs_all_markers: bool
    #: Every variable of its own that ``read`` reads, markers first.
    variables: tuple[str, ...]
    #: Reads the world from the environment; raises ``GangInitError`` naming a bad variable.
    read: Callable[[Mapping[str, str], HostnameExpander], WorldInfo]

    def detects(self, env: Mapping[str, str]) -> bool:
        """Whether ``env`` shows this launcher (its markers, by ``needs_all_markers``)."""
        present = [name in env for name in self.markers]
        return all(present) if self.needs_all_markers else any(present)

    def describe_markers(self) -> str:
        """What ``detects`` looks for, for messages: "`A` or `B`", "both `A` and `B`"."""
        names = [f"`{name}`" for name in self.markers]
        if not self.needs_all_markers:
            return " or ".join(names)
        return ("both " if len(names) == 2 else "all of ") + " and ".join(names)


TORCHRUN = Launcher(
    name="torchrun",
    owner="torchrun's",
    markers=("RANK", "WORLD_SIZE"),
    needs_all_markers=False,
    variables=(
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_USE_AGENT_STORE",
        "TORCHELASTIC_RUN_ID",
    ),
    read=_torchrun_world,
)
SLURM = Launcher(
    name="slurm",
    owner="SLURM's",
    markers=("SLURM_PROCID", "SLURM_NTASKS"),
    needs_all_markers=True,
    variables=(
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_LOCALID",
        "SLURM_NTASKS_PER_NODE",
        "SLURM_TASKS_PER_NODE",
        "SLURM_JOB_NODELIST",
        "SLURM_NODELIST",
        "SLURM_JOB_ID",
    ),
    read=_slurm_world,
)

#: The launchers agang knows, in the order they are tried: torchrun first, so that
#: ``srun torchrun`` (both sets of variables) reads torchrun's. ``agang store`` is no
#: launcher of its own: its ranks are started with torchrun's variables.
LAUNCHERS: tuple[Launcher, ...] = (TORCHRUN, SLURM)


def expand_nodelist(nodelist: str) -> list[str]:
    """The host names of a SLURM node list, e.g. ``"gpu[01-03,7],cpu1"``.

    Uses ``scontrol show hostnames`` when installed (it knows every SLURM syntax), else
    agang's parser of the common forms: comma-separated names with bracketed ranges.
    """
    if shutil.which("scontrol"):
        try:
            output = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout
            return output.split()
        except (subprocess.SubprocessError, OSError):
            pass  # fall back on the parser below
    return parse_nodelist(nodelist)


def parse_nodelist(nodelist: str) -> list[str]:
    """Expands ``prefix[a-b,c]suffix`` groups separated by commas (no nesting)."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", nodelist):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if match is None:
            hosts.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            low, _, high = item.partition("-")
            if not high:
                hosts.append(f"{prefix}{low}{suffix}")
                continue
            width = len(low)
            for number in range(int(low), int(high) + 1):
                hosts.append(f"{prefix}{number:0{width}d}{suffix}")
    return hosts
