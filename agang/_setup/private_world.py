"""A private world: this process's world gang over groups registered nowhere, its keys
under a namespace of a store that outlives its members (what ``agang.ray.join`` forms).

Rules:
1. The gang is an elastic gang's private world (``agang._setup.elastic_gang``, rule 7):
   formation, reform, blame and death notices as ``agang.init(elastic=...)`` has them;
   only the c10d registration differs, so that the process's default group, if any,
   stays its owner's. A fixed gang is ``Elastic(min_size=size, max_size=size)``:
   formation 0 waits for every member, rank = the member's given rank; a reform waits
   for all again, so it admits a lost member's replacement and no one else.
2. The device decides the transport, as for ``agang.init``: Gloo on the CPU, NCCL on a
   GPU (agang's NCCL settings applied), the simulated NCCL under ``AGANG_SIM_NCCL=1``.
   Order checks default as ``agang.init``'s do (on over Gloo).
3. Cancelling ``form`` stops the wait at once; the set-up thread winds down within the
   deadline, and a gang it made after all is closed, never left open holding the
   process's one world.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from agang._collective.process_group_gang import open_world_gang
from agang._errors import GangInitError
from agang._policy import CHECKS_ORDER_BY_DEFAULT, GangPolicy, make_policy
from agang._runtime.threads import start_daemon, start_thread
from agang._setup import simulation
from agang._setup.elastic import Elastic
from agang._setup.elastic_gang import ElasticGang, form_first
from agang._setup.env import WorldInfo
from agang._setup.process import apply_nccl_settings, resolve_backend, resolve_device

#: The deadline standing for "no bound" (seconds: ten years).
_NO_BOUND = 10 * 365 * 86400.0


class _Settings:
    """What a formation reads of its plan (``elastic_gang.Plan``)."""

    def __init__(self, backend: str, device: torch.device, policy: GangPolicy) -> None:
        self.backend = backend
        self.device = device
        self.policy = policy
        self.stream_ordered = False


async def form(
    *,
    store: str,
    rank: int,
    size: int,
    namespace: str,
    name: str,
    timeout: float | None,  # noqa: ASYNC109  # the formation's deadline, as init's
    op_timeout: float | None,
    elastic: Elastic | None,
    device: torch.device | str | None,
) -> ElasticGang:
    """This process's private world (module rules): member ``rank`` of ``size``, on the
    store at ``store`` ("HOST:PORT", checked by the caller) under ``namespace``, within
    ``timeout`` seconds (None: no bound)."""
    _check_no_world(name)
    host, port = store.rsplit(":", 1)
    world = WorldInfo(
        rank,
        size,
        0,
        host.removeprefix("[").removesuffix("]"),
        int(port),
        launcher_hosts_store=True,
        source="agang.ray",
    )
    chosen = resolve_device(device, None, world)
    backend = resolve_backend(None, chosen, simulated=simulation.requested(os.environ))
    if backend == "nccl":  # rule 2
        apply_nccl_settings(os.environ)
        if chosen.type == "cuda":
            torch.cuda.set_device(chosen)
    policy = make_policy(op_timeout=op_timeout, check_order=backend in CHECKS_ORDER_BY_DEFAULT)
    bounds = elastic or Elastic(min_size=size, max_size=size)  # rule 1
    settings = _Settings(backend, chosen, policy)
    return await _formed_within(
        lambda deadline: form_first(
            settings, world, bounds, deadline, namespace=namespace, name=name
        ),
        _NO_BOUND if timeout is None else timeout,
    )


def _check_no_world(name: str) -> None:
    """Refuses to form while this process's world gang is open, before anything is
    made or published: a second world would overwrite the first's record (its blame
    would name the other gang's ranks), and its peers would wait for a member that
    never makes its group."""
    gang = open_world_gang()
    if gang is not None:
        raise GangInitError(
            f"Gang '{name}' cannot be formed while this process's world gang '{gang.name}' "
            f"(rank {gang.rank} of {gang.size}) is still open: one process has one world "
            f"gang (one agang.ray.join, or agang.init). Close it first, or keep using it."
        )


async def _formed_within(form: Callable[[float], ElasticGang], seconds: float) -> ElasticGang:
    """``form(deadline)`` on a thread; a gang made after its caller gave up is closed
    (rule 3)."""
    lock = threading.Lock()
    state: dict[str, Any] = {"gave_up": False, "gang": None}

    def run() -> ElasticGang | None:
        gang = form(time.monotonic() + seconds)
        with lock:
            if not state["gave_up"]:
                state["gang"] = gang
                return gang
        gang.close_sync()
        return None

    future = start_thread(run, name="private world")
    try:
        made = await future
    except BaseException:
        with lock:
            state["gave_up"] = True
            orphan = state["gang"]
        if orphan is not None:  # made, and never handed over
            start_daemon(orphan.close_sync, name="agang: close an orphan gang")
        raise
    assert made is not None
    return made
