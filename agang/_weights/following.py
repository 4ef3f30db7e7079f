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
4. *Cancelled*, a rank whose shares are under way still sends the round's shares, for
   up to ``CANCEL_GRACE`` seconds plus their time at ``GRACE_BYTES_PER_SECOND`` (past
   that it closes the lane: rule 2), so that nothing reads its tensors once the call
   ended; one that awaited only a word or an outcome leaves it, and the next call takes
   it. So cancelling a push breaks nothing, on rank 0 or here.
5. *Outcomes are matched to versions.* An outcome for another version than the call's
   is an earlier push's, which a cancelled call left behind (or rank 0 refused before
   its round), when this call took part in no round of it: it is passed over. One whose
   round this call took part in is rank 0's judgement: the ranks pushed different
   versions, and this rank raises ``ValueError`` saying both. ``{"closed": ...}``:
   rank 0's publisher closed; every later push raises ``GangClosedError``.
"""

from __future__ import annotations

import json
import math
from typing import Any

import anyio
import torch

from agang._errors import GangClosedError, GangError, one_line
from agang._gang import Gang
from agang._handle import Handle
from agang._weights.gathering import (
    CANCEL_GRACE,
    DONE,
    GRACE_BYTES_PER_SECOND,
    INLINE_BYTES,
    ROUND,
    WORD_BYTES,
    read_control,
    shares,
)
from agang._weights.plan import Plan
from agang._weights.report import PushReport
from agang._weights.sharding import Layout

#: What rank 0 may take past a push's deadline (rule 3): its recovery, a check-in, and
#: the store's steps, with room.
SLACK_SECONDS = 30.0
#: How long a rank's ``close`` waits for rank 0's (rule 5).
CLOSE_SECONDS = 5.0
_IN_FLIGHT = 2


def outcome_of(text: bytes) -> dict[str, Any]:
    """A push's outcome, from rank 0's JSON (rule 1)."""
    outcome = json.loads(text.decode())
    if not isinstance(outcome, dict):
        raise GangError(f"rank 0 sent {type(outcome).__name__} as the push's outcome")
    return outcome


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
        self._word = torch.zeros(WORD_BYTES, dtype=torch.uint8, device=layouts[0].local.device)
        #: Why the lane is out of step (rule 2), or None.
        self.broken: str | None = None
        self.last: PushReport | None = None
        # Where the lane stands (rule 4): the word's receive, the next bucket to send
        # (None: no round), the buckets' sends in flight, the outcome's receive.
        self._heard: Handle[torch.Tensor] | None = None
        self._next: int | None = None
        self._flying: list[list[Handle[list[torch.Tensor]]]] = []
        self._outcome: Handle[torch.Tensor] | None = None

    async def push(self, version: int, seconds: float | None) -> PushReport:
        """This rank's part of the push of ``version`` (rules 1, 4, 5)."""
        if self.broken is not None:
            raise GangError(self._broken_words())
        timeout = math.inf if seconds is None else 2 * seconds + SLACK_SECONDS
        rounds: set[int] = set()  # the versions of the rounds this call took part in
        for _ in range(1_000_000):  # each pass takes one push's outcome
            try:
                outcome = await self._follow(timeout, rounds)
            except GangError as error:
                self._break(f"the push of version {version} failed: {one_line(error)}")
                raise GangError(
                    f"Channel '{self._channel}': trainer rank {self._lane.rank}'s part of "
                    f"the push of version {version} failed: {one_line(error)}"
                ) from error
            except BaseException:  # cancelled (rule 4)
                await self._cancelled(timeout)
                raise
            if "closed" in outcome:
                self.broken = str(outcome["closed"])
                raise GangClosedError(f"Channel '{self._channel}': {outcome['closed']}.")
            said = outcome.get("version")
            if said != version and not rounds:
                continue  # an earlier call's push, which that call gave up on (rule 5)
            if said != version:
                raise ValueError(
                    f"`version` must be the same on every trainer rank: rank 0 pushed "
                    f"{said}, this rank (rank {self._lane.rank}) {version}."
                )
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
        raise AssertionError("unreachable")

    async def close(self) -> None:
        """Takes rank 0's last words, up to its close, within ``CLOSE_SECONDS`` (rule 5):
        the ranks close together, and no op of the lane is left behind; past that, the
        lane is closed."""
        if self.broken is not None:
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_SECONDS) as waited:
            try:
                while "closed" not in await self._follow(CLOSE_SECONDS, set()):
                    pass  # an earlier push's outcome, which a cancelled call left
            except GangError as error:
                self._break(f"closing: {one_line(error)}")
                return
        if waited.cancelled_caught:
            self._break(f"rank 0 did not close within {CLOSE_SECONDS:g} s")
        else:
            self.broken = "closed"

    async def _cancelled(self, timeout: float) -> None:  # noqa: ASYNC109
        """A cancelled push (rule 4): shares in flight are sent on within the grace, so
        that nothing reads the tensors once the call ended; the lane's state is kept
        for the next call."""
        if self._next is None and not self._flying:
            return  # only a word or the outcome awaited: the next call takes it
        later = self._sends[self._next or 0 :]
        left = sum(view.numel() * view.element_size() for views in later for view in views)
        grace = CANCEL_GRACE + left / GRACE_BYTES_PER_SECOND
        with anyio.CancelScope(shield=True), anyio.move_on_after(grace) as waited:
            try:
                await self._send_round(timeout)
            except GangError as error:
                self._break(f"a cancelled push failed: {one_line(error)}")
        if waited.cancelled_caught:
            self._break(f"a cancelled push's shares were not sent within {grace:.1f} s")

    async def _follow(self, timeout: float, rounds: set[int]) -> dict[str, Any]:  # noqa: ASYNC109
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
                return outcome_of(bytes(text.cpu().numpy()))
            if self._heard is None:
                self._heard = lane.recv(self._word, 0, timeout=timeout)
            await self._heard
            self._heard = None
            what, value, _, rest = read_control(self._word)
            if what == DONE and value <= INLINE_BYTES:  # the outcome in the word
                return outcome_of(rest[:value])
            if what == DONE:  # the outcome's length, then the outcome (gathering rule 2)
                text = torch.empty(value, dtype=torch.uint8, device=self._word.device)
                self._outcome = lane.recv(text, 0, timeout=timeout)
            elif what == ROUND:
                rounds.add(value)
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
