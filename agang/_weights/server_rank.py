"""A sharded server's rank as its ``WeightSubscriber`` holds it: its slices' staging,
where its versions come from (rank 0's service, ``agang._weights.relay``, or the
relayed rounds of ``agang._weights.relayed``), and ``receive``'s agreement over the
gang's ``agree`` lane.

Rules:
1. *All or nothing per version.* ``receive`` is collective: the ranks exchange the
   version each holds whole (the highest and the lowest, in one all-reduce); where
   every rank holds the same new one, each copies its staging into its tensors under
   its staging lock, and the ranks agree that every copy was made (a rank whose
   staging moved on meanwhile says no, and all ask again). A version is returned only
   where every rank holds it.
2. *In step when cancelled.* The exchange's op, once issued, is kept until it ended: a
   ``receive`` cancelled or timed out while it waited for the other ranks leaves it
   for the next ``receive`` to take up. The copy and the agreement that follows run
   shielded and bounded (every rank is there by then).
3. *A rank that fails* (its rounds ended with an error: a rank lost, the publisher
   gone) closes the agree lane, so that every other rank's ``receive`` raises too; its
   own raises its rounds' error, the others theirs or the lane's, naming the failure.
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

#: The bound of the agreement after a copy (rule 2): every rank is there already.
AGREE_SECONDS = 30.0


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
                    with anyio.fail_after(max(0.0, min(deadline - time.monotonic(), 86400.0))):
                        await asked  # cancelled or timed out: the next call takes it up
                except TimeoutError:
                    raise TimeoutError(timed_out()) from None
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
        """Copies ``version`` into the tensors where staging still holds it, and agrees
        with the other ranks that every one did (rule 1)."""
        source = self.source

        def take() -> bool:
            with source.staging:
                if source.ready != version:
                    return False
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
                return True

        took = await run_blocking(take, name="weights: receive", seconds=None)
        word = self._word([1 if took else 0])
        try:
            await self.agree.all_reduce(word, ReduceOp.MIN, timeout=AGREE_SECONDS)
        except GangError as failed:
            raise self._lost(failed) from failed
        return int(word[0]) == 1

    def _lost(self, failed: GangError) -> GangError:
        """Why ``receive`` failed on the agree lane (rule 3)."""
        self.agree.close_sync()
        error = self.source.error
        if error is not None:
            return GangError(str(error))
        return GangError(
            f"Subscriber '{self.name}': a rank of its server's gang failed or was lost, "
            f"so no version is whole on every rank: {one_line(failed)}"
        )

    def stop(self) -> None:
        """A rank > 0 stops: its rounds and its lanes; on rank 0, the agree lane (its
        service stops with the subscriber, and closes the relay lane)."""
        if isinstance(self.source, Relayed):
            self.source.stop(5.0)
        self.agree.close_sync()
