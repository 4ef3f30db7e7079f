"""Where a job's gangs meet, and who watches their actors: ``store()`` on the driver, and
the watcher's look-up inside an actor (``agang.ray._keeper``'s rules)."""

from __future__ import annotations

import logging
import os
from typing import Any

import anyio
import ray

from agang._membership import store as stores
from agang._membership.member import Member
from agang._validate import check_deadline
from agang.ray._keeper import STORE_NAME, WATCH_PREFIX, Keeper
from agang.ray._why import actor_label

log = logging.getLogger("agang.ray")

_warned: set[str] = set()
#: The keepers this driver got or started, by name: Ray ends an actor once no handle to
#: it is left, named or not, and the driver holds its keepers for as long as it lives.
_kept: dict[str, Any] = {}


def store(
    address: str | None = None,
    *,
    host: str | None = None,
    timeout: float | None = 60.0,  # a driver's blocking call
) -> str:
    """The job's store, on the driver: gets or starts the keeper actor that serves it
    and watches the members' deaths, and returns the store's "HOST:PORT".

    The keeper is named ``agang-store`` in the job's namespace and owned by the driver
    (not detached): it ends with the driver, and every call of the job gets the same
    one. With ``address``, an ``agang store`` that must outlive the driver, the keeper
    (``agang-watch:ADDRESS``) only watches, and ``address`` is returned.

    Args:
        address: An ``agang store``'s "HOST:PORT" (None: the job's own store).
        host: The address the job's own store listens on (None: the node's address as
            Ray gives it; ``"127.0.0.1"`` for a one-machine cluster).
        timeout: Seconds to wait for the keeper to start (None: 60 s; ``math.inf``: no
            bound).

    Raises:
        RuntimeError: Ray is not initialized in this process.
        ValueError: An argument is invalid (the message names it).

    Example:
        <!-- not-run: needs a Ray cluster -->
        ```python
        ray.init()
        address = agang.ray.store()
        ```
    """
    if address is not None:
        stores.parse_address(address, name="address")
    given: object = host  # untyped callers
    if given is not None and (not isinstance(given, str) or not given.strip()):
        raise ValueError(f"`host` must be a non-empty str or None, but is {host!r} instead.")
    seconds = check_deadline(timeout, name="timeout", default=60.0)
    if not ray.is_initialized():
        raise RuntimeError("agang.ray.store() needs Ray: call ray.init() first.")
    name = STORE_NAME if address is None else f"{WATCH_PREFIX}{address}"
    keeper: Any = (
        ray.remote(Keeper)
        .options(name=name, get_if_exists=True, num_cpus=0, max_restarts=0)
        .remote(host, address)
    )
    ray.get(keeper.ready.remote(), timeout=seconds)
    found: str = ray.get(keeper.address.remote(), timeout=seconds)
    _kept[name] = keeper
    return found


def death_notices(
    address: str | None = None,
    *,
    timeout: float | None = 60.0,  # a driver's blocking call
) -> list[str]:
    """What the job's watcher told the gangs and channels of its store, oldest first:
    one line per death Ray reported ("actor 'NAME' (node N, pid P) died (Ray: ...)"),
    for a driver's log or timeline. Blocks; call it where ``store()`` was called.

    Args:
        address: The store the watcher serves, as given to ``store()`` (None: the
            job's own).
        timeout: Seconds to wait for the watcher's answer (None: 60 s; ``math.inf``:
            no bound).

    Raises:
        RuntimeError: Ray is not initialized in this process.
        ValueError: No watcher serves that store in this job (``store()`` was not
            called), or an argument is invalid.

    Example:
        <!-- not-run: needs a Ray cluster -->
        ```python
        for line in agang.ray.death_notices():
            print(line)
        ```
    """
    if address is not None:
        stores.parse_address(address, name="address")
    seconds = check_deadline(timeout, name="timeout", default=60.0)
    if not ray.is_initialized():
        raise RuntimeError("agang.ray.death_notices() needs Ray: call ray.init() first.")
    name = STORE_NAME if address is None else f"{WATCH_PREFIX}{address}"
    try:
        keeper: Any = ray.get_actor(name)
    except ValueError:
        raise ValueError(
            f"No watcher '{name}' runs in this job: call agang.ray.store("
            f"{'' if address is None else repr(address)}) first."
        ) from None
    filed = ray.get(keeper.filed.remote(), timeout=seconds)
    return [str(why) for why, _, _ in filed]


async def watcher_for(address: str) -> Any:
    """The keeper that watches for the store at ``address``, or None (none started)."""

    def look(name: str) -> Any:
        try:
            return ray.get_actor(name)
        except ValueError:  # no such actor in this namespace
            return None

    own = await anyio.to_thread.run_sync(look, STORE_NAME)
    if own is not None and await own.address.remote() == address:
        return own
    return await anyio.to_thread.run_sync(look, f"{WATCH_PREFIX}{address}")


async def arm(address: str, what: str) -> bool:
    """Has the keeper of ``address`` watch this actor (``keeper``'s rule 2), for
    ``what`` (a gang's or a channel's name, in the warning where it cannot); whether
    it does."""
    context = ray.get_runtime_context()
    actor = context.current_actor
    if not hasattr(actor, "agang_parked"):
        _warn_once(
            what,
            f"agang: {what}: this actor's class does not mix in agang.ray.Member, so its "
            f"death reaches its peers only through deadlines and lost connections, not "
            f"from Ray.",
        )
        return False
    keeper = await watcher_for(address)
    if keeper is None:
        _warn_once(
            what,
            f"agang: {what}: no watcher serves the store at {address} (start it with "
            f"agang.ray.store() on the driver), so Ray's death reports are not heard.",
        )
        return False
    label = actor_label(context.get_actor_name(), context.get_node_id(), os.getpid())
    await keeper.arm.remote(actor, Member.here(), label)
    return True


def _warn_once(what: str, message: str) -> None:
    if what not in _warned:
        _warned.add(what)
        log.warning(message)
