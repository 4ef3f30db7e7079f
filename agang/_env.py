"""The world a process belongs to, read from its launcher's environment.

torchrun's contract: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (and
TORCHELASTIC_USE_AGENT_STORE when the launcher itself hosts the store). The mapping is
injectable so parsing is tested with plain dicts. SLURM's variables come in a later
version of this module; the result type already has what they need.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from agang._errors import GangInitError


@dataclass(frozen=True)
class WorldInfo:
    """Where this process sits in its job, and where the rendezvous store lives."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    #: True when the launcher (torchrun's agent) already hosts the store.
    launcher_hosts_store: bool = False
    #: Where the values came from, for messages: "torchrun" or "arguments".
    source: str = "torchrun"

    @property
    def store_address(self) -> str:
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


def world_from_env(env: Mapping[str, str]) -> WorldInfo | None:
    """Reads torchrun's variables; None when none of RANK and WORLD_SIZE is set.

    Raises:
        GangInitError: A variable is set but invalid (not an integer, rank not below the
            world size, one of a required pair missing); the message names it.
    """
    has_rank = "RANK" in env
    has_size = "WORLD_SIZE" in env
    if not has_rank and not has_size:
        return None
    if has_rank != has_size:
        present, missing = ("RANK", "WORLD_SIZE") if has_rank else ("WORLD_SIZE", "RANK")
        raise GangInitError(
            f"`{missing}` must be set when `{present}` is, but is missing; start the job "
            f"with torchrun or set both."
        )
    world_size = _int(env, "WORLD_SIZE", minimum=1)
    rank = _int(env, "RANK", minimum=0)
    if rank >= world_size:
        raise GangInitError(
            f"`RANK` must be less than `WORLD_SIZE` ({world_size}), but is {rank} instead."
        )
    local_rank = _int(env, "LOCAL_RANK", minimum=0) if "LOCAL_RANK" in env else rank
    if world_size > 1:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not env.get(name):
                raise GangInitError(
                    f"`{name}` must be set for a world of size {world_size}, but is missing."
                )
    port = _int(env, "MASTER_PORT", minimum=0) if env.get("MASTER_PORT") else 0
    if port > 65535:
        raise GangInitError(f"`MASTER_PORT` must be at most 65535, but is {port} instead.")
    return WorldInfo(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=port,
        launcher_hosts_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() in ("1", "true"),
    )
