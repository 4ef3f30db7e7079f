"""A trainer gang's push, on a rank other than 0: its shares of each bucket sent to
rank 0 over the lane, and the push's outcome taken from it (``agang._weights.gathering``
rules 1, 2).

Rules:
1. Each round rank 0 announces, this rank sends its shares of every bucket, in plan
   order, as views of its local tensors (no copy, no memory), at most two buckets'
   sends in flight; then it waits for the next word. ``DONE`` brings the push's
   outcome: the report rank 0 made, or why the push failed there, raised here as
   ``GangError`` with rank 0's words.
2. An op of the lane that fails (rank 0 lost, or the lane closed by rank 0 after a
   share did not come) fails the push, saying so with the op's blame, and leaves the
   lane out of step: later pushes raise at once (``agang._weights.gathering`` rule 4).
3. The lane's ops are bounded by the push's deadline plus what rank 0 may take past it
   (recovery, a joiner's check-in): a rank 0 that is alive always ends the push; one
   that died ends the lane's connections at once.
4. *Cancelled*, the rank still sends the round's shares and takes the outcome, for up
   to ``CANCEL_GRACE`` seconds, so that the lane stays in step; past that it closes
   the lane (rule 2).
"""

from __future__ import annotations

import json
import math
from typing import Any

import anyio
import torch

from agang._errors import GangError, one_line
from agang._gang import Gang
from agang._handle import Handle
from agang._weights.gathering import CONTROL_WORDS, DONE, ROUND, shares
from agang._weights.plan import Plan
from agang._weights.report import PushReport
from agang._weights.sharding import Layout

#: What rank 0 may take past a push's deadline (rule 3): its recovery, a check-in, and
#: the store's steps, with room.
SLACK_SECONDS = 30.0
#: How long a cancelled push keeps the lane in step (rule 4).
CANCEL_GRACE = 1.0
_IN_FLIGHT = 2


class Following:
    """A rank's part of its trainer gang's pushes (module rules)."""

    def __init__(self, plan: Plan, layouts: list[Layout], lane: Gang, channel: str) -> None:
        self.plan = plan
        self._lane = lane
        self._channel = channel
        rank = lane.rank
        self._sends: list[list[torch.Tensor]] = []
        for index, (_, nbytes, _) in enumerate(plan.buckets()):
            bucket = torch.empty(nbytes, dtype=torch.uint8, device="meta")
            mine = shares(plan, layouts, index, bucket, rank)
            self._sends.append([local for r, _, local in mine if r == rank and local is not None])
        self._word = torch.zeros(CONTROL_WORDS, dtype=torch.int64, device=layouts[0].local.device)
        #: Why the lane is out of step (rule 2), or None.
        self.broken: str | None = None
        self.last: PushReport | None = None
        # Where the lane stands (rule 4): the word's broadcast, the next bucket to send
        # (None: no round), the buckets' sends in flight, the outcome's broadcast.
        self._heard: Handle[torch.Tensor] | None = None
        self._next: int | None = None
        self._flying: list[list[Handle[list[torch.Tensor]]]] = []
        self._outcome: Handle[torch.Tensor] | None = None

    async def push(self, version: int, seconds: float | None) -> PushReport:
        """This rank's part of the push of ``version`` (rule 1)."""
        if self.broken is not None:
            raise GangError(self._broken_words())
        timeout = math.inf if seconds is None else 2 * seconds + SLACK_SECONDS
        try:
            outcome = await self._follow(timeout)
        except GangError as error:
            self._break(f"the push of version {version} failed: {one_line(error)}")
            raise GangError(
                f"Channel '{self._channel}': trainer rank {self._lane.rank}'s part of the "
                f"push of version {version} failed: {one_line(error)}"
            ) from error
        except BaseException:  # cancelled: keep the lane in step if it can (rule 4)
            with anyio.CancelScope(shield=True), anyio.move_on_after(CANCEL_GRACE) as grace:
                try:
                    await self._follow(timeout)
                except GangError as error:
                    self._break(f"a cancelled push failed: {one_line(error)}")
            if grace.cancelled_caught:
                self._break(f"a cancelled push did not end within {CANCEL_GRACE:g} s")
            raise
        if "error" in outcome:
            raise GangError(str(outcome["error"]))
        report = outcome["report"]
        made = PushReport(
            version=int(report["version"]),
            delivered=tuple(report["delivered"]),
            dropped=dict(report["dropped"]),
            seconds=float(report["seconds"]),
            bytes=int(report["bytes"]),
            epoch=int(report["epoch"]),
        )
        self.last = made
        return made

    async def _follow(self, timeout: float) -> dict[str, Any]:  # noqa: ASYNC109
        """Follows the lane's words until ``DONE``; the push's outcome (rule 1). Every op
        it awaits is kept until it ended, so that a call cancelled anywhere goes on where
        it stopped when called again (rule 4)."""
        lane = self._lane
        while True:
            if self._next is not None:
                await self._send_round(timeout)
            if self._outcome is not None:
                text = await self._outcome
                self._outcome = None
                outcome = json.loads(bytes(text.cpu().numpy()).decode())
                if not isinstance(outcome, dict):
                    raise GangError(f"rank 0 sent {type(outcome).__name__} as the push's outcome")
                return outcome
            if self._heard is None:
                self._heard = lane.broadcast(self._word, 0, timeout=timeout)
            await self._heard
            self._heard = None
            what = int(self._word[0])
            if what == DONE:  # the outcome's length, then the outcome (gathering rule 2)
                text = torch.empty(int(self._word[1]), dtype=torch.uint8, device=self._word.device)
                self._outcome = lane.broadcast(text, 0, timeout=timeout)
            elif what == ROUND:
                self._next = 0
            else:
                raise GangError(f"rank 0 sent an unknown word {what} on the lane")

    async def _send_round(self, timeout: float) -> None:  # noqa: ASYNC109
        """Every bucket's shares, in order, two buckets in flight at most (rule 1)."""
        assert self._next is not None
        while self._next < len(self._sends):
            views = self._sends[self._next]  # one batch a bucket, as rank 0 takes it
            batch = [(view, 0) for view in views]
            self._flying.append(
                [self._lane.exchange(sends=batch, timeout=timeout)] if batch else []
            )
            self._next += 1
            while len(self._flying) > _IN_FLIGHT:
                await self._landed()
        while self._flying:
            await self._landed()
        self._next = None

    async def _landed(self) -> None:
        """Awaits the oldest bucket's sends (again, after a cancel: rule 4)."""
        for handle in self._flying[0]:
            await handle
        self._flying.pop(0)

    def _break(self, why: str) -> None:
        if self.broken is None:
            self.broken = why
        self._lane.close_sync()  # rank 0's ops with this rank end (rule 2)

    def _broken_words(self) -> str:
        return (
            f"Channel '{self._channel}': this publisher (trainer rank {self._lane.rank}) can "
            f"push no more: {self.broken}. Open a publisher again (over the gang re-formed, "
            f"where it lost a rank)."
        )
