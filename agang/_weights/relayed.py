"""A sharded server's rounds, on a rank other than 0: its shares of each version taken
from rank 0 over the relay lane (``agang._weights.relay`` rules 1, 2), on a thread and
an event loop of its own, like the service's (``agang._weights.service`` rule 1).

Rules:
1. Each round rank 0 announces, this rank receives its shares of every bucket straight
   into its staging (or, in place, its own tensors), in plan order, at most
   ``IN_FLIGHT`` (two) buckets' receives in flight: a bucket's are posted once the
   bucket two before it came; then it acknowledges the version to rank 0, and marks it ready
   once rank 0 ends the round with ``COMMIT`` (``ABORT``: the round stopped part way,
   and staging holds no version: ``agang._weights.relay`` rule 2). ``receive`` copies
   staging under the same lock (``staging``), as a whole server's does.
2. ``CLOSE`` (rank 0's service ended: ``agang._weights.relay`` rule 6) ends the
   rounds with rank 0's reason: a ``GangClosedError`` where the publisher closed the
   channel, a normal end, as on rank 0; else a ``GangError`` saying why rank 0 ended.
3. An op of the lane that fails (rank 0 lost or closed, or it closed the lane when
   another rank was lost) ends the rounds with ``error``, naming rank 0's side, for
   ``receive`` to raise.
"""

from __future__ import annotations

import asyncio
import math
import threading

import torch

from agang._errors import GangClosedError, GangError, one_line
from agang._gang import Gang
from agang._handle import Handle
from agang._runtime.future import Future, finish
from agang._runtime.threads import start_daemon
from agang._weights.plan import Plan
from agang._weights.relay import ABORT, CLOSE, COMMIT, CONTROL_WORDS, DATA, server_shares
from agang._weights.sharding import Layout

#: The most buckets whose receives are in flight at once (rule 1).
IN_FLIGHT = 2


class Relayed:
    """A rank's part of its sharded server's rounds (module rules)."""

    def __init__(
        self, plan: Plan, layouts: list[Layout], lane: Gang, name: str, timeout: float | None
    ) -> None:
        self._lane = lane
        self._name = name
        self._timeout = math.inf if timeout is None else timeout
        rank = lane.rank
        self._recvs: list[list[torch.Tensor]] = []
        for index, (_, nbytes, _) in enumerate(plan.buckets()):
            bucket = torch.empty(nbytes, dtype=torch.uint8, device="meta")
            mine = server_shares(plan, layouts, index, bucket, rank, lane.size)
            self._recvs.append([local for r, _, local in mine if r == rank and local is not None])
        self._device = layouts[0].local.device
        self.staging = threading.Lock()
        self._state = threading.Lock()
        self.ready: int | None = None
        self.taken: int | None = None
        self.error: GangError | None = None
        self._news: Future[None] = Future("weights news")
        self._stopping = threading.Event()
        self._thread = start_daemon(self._run, name=f"agang: weights server rank {rank} {name}")

    def news(self) -> Future[None]:
        """A future that finishes at the next version or error."""
        with self._state:
            return self._news

    def _tell(self) -> None:
        with self._state:
            news, self._news = self._news, Future("weights news")
        finish(news, None, None)

    def _run(self) -> None:
        try:
            asyncio.run(self._rounds())
        except GangClosedError as error:
            self.error = error
        except GangError as error:
            if not self._stopping.is_set():
                self.error = GangError(
                    f"Subscriber '{self._name}' (server rank {self._lane.rank}) lost its "
                    f"server gang's rank 0, which relays the versions: {one_line(error)}"
                )
                self.error.__cause__ = error
        finally:
            self._tell()

    async def _rounds(self) -> None:
        lane = self._lane
        word = torch.zeros(CONTROL_WORDS, dtype=torch.int64, device=self._device)
        while not self._stopping.is_set():
            await lane.recv(word, 0, timeout=math.inf)
            what, version, _ = (int(x) for x in word.tolist())
            if what == CLOSE:
                self.error = await self._closed(version, bool(word[2]))
                return
            if what != DATA:
                raise GangError(f"rank 0 sent an unknown word {what} on the relay lane")
            with self.staging:
                self.ready = None  # staging is being written (rule 1)
                flying: list[list[Handle[torch.Tensor]]] = []
                for views in self._recvs:
                    while len(flying) >= IN_FLIGHT:  # rule 1
                        for handle in flying.pop(0):
                            await handle
                    flying.append([lane.recv(v, 0, timeout=self._timeout) for v in views])
                for handles in flying:
                    for handle in handles:
                        await handle
            ack = torch.tensor([version], dtype=torch.int64, device=self._device)
            await lane.send(ack, 0, timeout=self._timeout)
            await lane.recv(word, 0, timeout=self._timeout)  # the round's end (rule 1)
            if int(word[0]) == COMMIT:
                with self.staging:
                    self.ready = version
                self._tell()
            elif int(word[0]) != ABORT:
                raise GangError(f"rank 0 ended a round with an unknown word {int(word[0])}")

    async def _closed(self, nbytes: int, normal: bool) -> GangError:
        """The end rank 0 said, with its reason (``nbytes`` of text; rule 2)."""
        text = torch.zeros(nbytes, dtype=torch.uint8, device=self._device)
        if nbytes:
            await self._lane.recv(text, 0, timeout=self._timeout)
        why = bytes(text.tolist()).decode(errors="replace") or "no reason given"
        kind = GangClosedError if normal else GangError
        return kind(
            f"Subscriber '{self._name}' (server rank {self._lane.rank}) ended with its "
            f"rank 0, the channel's member: {why}"
        )

    def stop(self, seconds: float) -> None:
        """Ends the rounds: the lane is closed under them."""
        self._stopping.set()
        self._lane.close_sync()
        self._thread.join(seconds)
