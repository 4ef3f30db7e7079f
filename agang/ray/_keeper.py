"""The job's store and death watcher: one Ray actor, ``Keeper``, owned by the driver.

Rules:
1. *The store.* ``agang.ray.store()`` starts one keeper per job, named ``agang-store``
   in the job's namespace and owned by the driver (never detached): it serves c10d's
   ``TCPStore`` (torch's own server, as ``agang store`` does) on the node it runs on,
   and ends with the driver, leaking nothing. For a store that must outlive the driver,
   the user runs ``agang store`` and passes its address: a keeper named
   ``agang-watch:ADDRESS`` then only watches. Ray's internal KV is never used (private,
   and not a c10d store).
2. *One pending call per actor.* A member arms the watch itself, once it is in (only it
   knows its pid and where it runs): ``arm`` starts one call of the member's
   ``agang_parked`` (``agang.ray.Member``) and returns. Gangs and channels on one actor
   share its call (keyed by the actor and its pid); a restarted incarnation, with a new
   pid, arms a call of its own. N actors cost N calls, not N x N, and no polling of
   Ray's state and no health loop of agang's own.
3. *A failed call is a death notice.* When Ray fails the call with ``ActorDiedError``,
   the keeper files a notice naming the process as its members know it ("HOST, pid
   N"), saying which actor and Ray's words (``agang.ray._why``), on a store client it
   keeps open: every listener (an elastic gang's members, a publisher) hears of it
   within milliseconds of Ray. The call is made without retries (``max_task_retries=
   0``), so an actor whose class retries its tasks is not called again in its next
   incarnation instead. A call that returns, or fails otherwise, files nothing. Ray
   does not see a stopped (wedged) actor: deadlines stay for that.
5. *Unavailable is asked, not believed.* ``ActorUnavailableError`` means a restart,
   or a fault that passes: the keeper asks the actor's pid (``agang_pid``) until it
   answers, or ``VERIFY_SECONDS`` pass. Another pid, a death, or no answer files the
   notice for the old pid; the same pid was a passing fault, and the watch goes on.
4. The keeper's blocking work (serving, connecting, filing) runs on threads, never on
   the actor's event loop, so a notice is never held behind another.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta
from typing import Any

import ray
import torch.distributed as dist

from agang._membership import deaths
from agang._membership import store as stores
from agang._membership.member import Member
from agang._setup.rendezvous import listen_on
from agang.ray._why import death_why

log = logging.getLogger("agang.ray")

#: The name of the job's own keeper (rule 1), and of one that watches for ``ADDRESS``.
STORE_NAME = "agang-store"
WATCH_PREFIX = "agang-watch:"
#: How long the keeper tries to reach an external store before filing fails (seconds).
CONNECT_SECONDS = 10.0
#: How long an unavailable actor is asked for its pid (rule 5; seconds).
VERIFY_SECONDS = 60.0


class Keeper:
    """The job's store and watcher (module rules). Runs as a Ray actor."""

    def __init__(self, host: str | None, address: str | None) -> None:
        self._server: Any = None
        if address is None:  # rule 1: this job's own store
            host = host or str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
            listener = listen_on(host, 0)
            if listener is None:
                raise RuntimeError(f"The store could not listen on {host}.")
            port = listener.getsockname()[1]
            self._server = dist.TCPStore(  # type: ignore[attr-defined]
                host,
                port,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(days=1),
                master_listen_fd=listener.detach(),
            )
            address = stores.address(host, port)
        self._address = address
        self._client: Any = None
        self._watched: set[tuple[Any, str]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._filed: list[tuple[str, int, float]] = []
        self._by = f"Ray's watcher ({Member.here()})"

    async def address(self) -> str:
        """The store's "HOST:PORT"."""
        return self._address

    async def filed(self) -> list[tuple[str, int, float]]:
        """The death notices this keeper filed: each one's why, how many listeners it
        reached, and how long after Ray's word it was filed (seconds)."""
        return list(self._filed)

    async def arm(self, actor: Any, who: str, label: str) -> bool:
        """Watches ``actor`` (rule 2), which runs as ``who`` ("HOST, pid N") and is
        ``label`` in notices; False where it was watched already."""
        key = (actor, who)
        if key in self._watched:
            return False
        self._watched.add(key)
        task = asyncio.get_running_loop().create_task(self._watch(key, actor, label))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _watch(self, key: tuple[Any, str], actor: Any, label: str) -> None:
        try:
            while True:
                # Started at once (Ray tells its end); never retried (rule 3).
                call = actor.agang_parked.options(max_task_retries=0).remote()
                try:
                    await call
                except ray.exceptions.ActorUnavailableError as error:  # rule 5
                    if await self._still_there(actor, key[1]):
                        continue  # a passing fault: watch the same incarnation again
                    await self._report(key[1], label, error)
                except ray.exceptions.RayActorError as error:  # rule 3
                    await self._report(key[1], label, error)
                return
        except Exception:
            log.debug("agang: a watch ended without a death.", exc_info=True)
        finally:
            self._watched.discard(key)

    async def _still_there(self, actor: Any, who: str) -> bool:
        """Whether the incarnation that runs as ``who`` still answers (rule 5)."""
        deadline = time.monotonic() + VERIFY_SECONDS
        while time.monotonic() < deadline:
            try:
                pid = await actor.agang_pid.options(max_task_retries=0).remote()
            except ray.exceptions.ActorUnavailableError:
                await asyncio.sleep(0.05)
                continue
            except ray.exceptions.RayActorError:
                return False
            return who.endswith(f", pid {pid}")
        return False

    async def _report(self, who: str, label: str, error: BaseException) -> None:
        """Files the notice of ``who``'s death (rule 3)."""
        notice = deaths.Notice(who, death_why(label, error), self._by)
        seen = time.monotonic()
        try:
            told = await asyncio.to_thread(self._file, notice)
        except Exception:
            log.warning("agang: a death notice could not be filed.", exc_info=True)
        else:
            self._filed.append((notice.why, told, time.monotonic() - seen))

    def _file(self, notice: deaths.Notice) -> int:
        self._connect()
        return deaths.report(self._client, notice)

    async def ready(self) -> bool:
        """True once the keeper is up (its store listening, its client connected)."""
        await asyncio.to_thread(self._connect)
        return True

    def _connect(self) -> None:
        if self._client is None:  # kept open: a notice costs one round trip per listener
            host, port = stores.parse_address(self._address, name="store")
            self._client = stores.connect(
                host,
                port,
                time.monotonic() + CONNECT_SECONDS,
                need="Ray's death notices need",
                who="the watcher",
            )
