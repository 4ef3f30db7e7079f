"""A sharded server's rank as its ``WeightSubscriber`` holds it: its slices' staging,
where its versions come from (rank 0's service, ``agang._weights.relay``, or the
relayed rounds of ``agang._weights.relayed``), and ``receive``'s agreement over the
gang's ``agree`` lane.

Rules:
1. *All or nothing per version.* ``receive`` is collective: the ranks exchange the
   version each holds whole (the highest and the lowest, in one all-reduce); where
   every rank holds the same new one, the ranks vote, each holding its staging lock
   (a rank whose staging is being written, or moved on, says no, and all ask again),
   and only on every rank's yes does each copy its staging into its tensors, under
   that lock. A version is returned only where every rank holds it, and the tensors
   never hold different versions across the ranks. A ``receive`` that times out or is
   cancelled in the vote or the copy still ends both (rule 2). What no protocol can
   close: the vote's op ending well on one rank and failing on another (a connection
   lost as it finished); that rank raises and closes the agree lane (rule 3), so the
   server can take no further version on any rank.
2. *In step when cancelled.* The exchange's op, once issued, is kept until it ended: a
   ``receive`` cancelled or timed out while it waited for the other ranks leaves it
   for the next ``receive`` to take up. The vote and the copy run shielded and bounded
   (every rank is there by then).
3. *A rank that fails* (its rounds ended with an error: a rank lost, the publisher
   gone or closed) closes the agree lane, so that every other rank's ``receive`` raises
   too; its own raises its rounds' error (a normal close stays a ``GangClosedError``),
   the others theirs or the lane's, naming the failure. A wait for the other ranks
   looks at its own rounds every ``_LOOK`` seconds.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import anyio
import torch

from agang._errors import GangClosedError, GangError, one_line
from agang._gang import Gang
from agang._handle import Handle
from agang._reduce_op import ReduceOp
from agang._runtime.threads import run_blocking
from agang._weights.buckets import as_bytes, copy_bytes
from agang._weights.relay import Relay
from agang._weights.relayed import Relayed
from agang._weights.service import Service

#: The bound of the agreement before a copy (rule 2): every rank is there already.
AGREE_SECONDS = 30.0
#: How often a wait for the other ranks looks at this rank's own rounds (rule 3).
_LOOK = 0.1


@dataclasses.dataclass
class ServerRank:
    """One rank of a sharded server (module rules)."""

    agree: Gang
    source: Service | Relayed
    #: The slices' staging (the user's own tensors, in place), by name.
    staging: dict[str, torch.Tensor]
    #: The user's local tensors, by name.
    tensors: dict[str, torch.Tensor]
    #: Per alias, the index of the tensor it is (``agang._weights.plan`` rule 4).
    ties: dict[int, int]
    in_place: bool
    #: The subscriber's name.
    name: str
    relay: Relay | None = None
    #: The exchange in flight (rule 2): its word and its op.
    asking: tuple[torch.Tensor, Handle[torch.Tensor]] | None = None

    @property
    def staging_bytes(self) -> int:
        """The slice's staging, and on rank 0 the relay's buffers."""
        held = (
            0 if self.in_place else sum(t.numel() * t.element_size() for t in self.staging.values())
        )
        if self.relay is not None:
            held += self.relay.first_bytes + self.relay.allocated_bytes
        return held

    def _word(self, values: list[int]) -> torch.Tensor:
        device = next(iter(self.staging.values())).device
        return torch.tensor(values, dtype=torch.int64, device=device)

    async def next_version(
        self, version: int | None, deadline: float, timed_out: Callable[[], str]
    ) -> int:
        """The next version newer than ``version`` that every rank holds, copied into
        the tensors (rules 1, 2)."""
        newer = -1 if version is None else version
        for _ in range(1_000_000):  # each pass waits for news, or ends
            news = self.source.news()
            error = self.source.error
            if error is not None:  # rule 3; a normal close stays a GangClosedError
                self.agree.close_sync()
                kind = GangClosedError if isinstance(error, GangClosedError) else GangError
                raise kind(str(error)) from error
            ready = self.source.ready
            if self.asking is None and ready is not None and ready > newer:
                word = self._word([ready, -ready])
                self.asking = (word, self.agree.all_reduce(word, ReduceOp.MAX, timeout=math.inf))
            if self.asking is not None:
                word, asked = self.asking
                try:
                    # Cancelled or timed out: the next call takes it up (rule 2); this
                    # rank's own rounds ending meanwhile end the wait (rule 3).
                    while not asked.done():
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise TimeoutError(timed_out())
                        with anyio.move_on_after(min(left, _LOOK)):
                            await asked
                        if not asked.done() and self.source.error is not None:
                            raise self._lost(None)
                    await asked
                except GangError as failed:
                    self.asking = None
                    raise self._lost(failed) from failed
                self.asking = None
                top, low = int(word[0]), -int(word[1])
                if top == low and top > newer:
                    with anyio.CancelScope(shield=True):  # rule 2
                        if await self._take(top):
                            return top
                continue  # a rank was writing a newer one: ask again
            with anyio.move_on_after(max(0.0, min(deadline - time.monotonic(), 86400.0))):
                await news
            if time.monotonic() >= deadline:
                raise TimeoutError(timed_out())
        raise AssertionError("unreachable")

    async def _take(self, version: int) -> bool:
        """Agrees with the other ranks that every one's staging holds ``version``, then
        copies it into the tensors; a rank whose staging is being written says no, and
        none copies (rule 1). Each holds its staging lock from its vote to its copy."""
        source = self.source
        held = source.staging.acquire(blocking=False)  # a round under way: no
        try:
            word = self._word([1 if held and source.ready == version else 0])
            try:
                await self.agree.all_reduce(word, ReduceOp.MIN, timeout=AGREE_SECONDS)
            except GangError as failed:
                raise self._lost(failed) from failed
            if int(word[0]) != 1:
                return False

            def take() -> None:
                if not self.in_place:
                    for name, staged in self.staging.items():
                        if staged.numel():
                            copy_bytes(as_bytes(self.tensors[name]), as_bytes(staged))
                names = list(self.tensors)
                for alias, first in self.ties.items():
                    into, came = self.tensors[names[alias]], self.tensors[names[first]]
                    if into.numel() and into.data_ptr() != came.data_ptr():
                        copy_bytes(as_bytes(into), as_bytes(came))
                source.taken = version

            await run_blocking(take, name="weights: receive", seconds=None)
            return True
        finally:
            if held:
                source.staging.release()

    def _lost(self, failed: GangError | None) -> GangError:
        """Why ``receive`` failed (rule 3): this rank's rounds' error, keeping its kind
        (a normal close stays a ``GangClosedError``), else the agree lane's."""
        self.agree.close_sync()
        error = self.source.error
        if error is not None:
            kind = GangClosedError if isinstance(error, GangClosedError) else GangError
            return kind(str(error))
        return GangError(
            f"Subscriber '{self.name}': a rank of its server's gang failed or was lost, "
            f"so no version is whole on every rank: "
            f"{'its lane was closed' if failed is None else one_line(failed)}"
        )

    def stop(self) -> None:
        """A rank > 0 stops: its rounds and its lanes; on rank 0, the agree lane (its
        service stops with the subscriber, and closes the relay lane)."""
        if isinstance(self.source, Relayed):
            self.source.stop(5.0)
        self.agree.close_sync()
