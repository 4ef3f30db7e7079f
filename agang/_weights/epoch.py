"""One epoch's rounds: what bucket 0's header says, and the epoch's gang's name.

Rules:
1. Each epoch runs on a gang of its own, made by the channel's factory
   (``agang._membership.gangs``): a Gloo or NCCL group over the store in production, never
   the process's default group, so that a trainer or a server that has a gang of its
   own keeps it. The channel's rounds use the gang's public interface only.
2. The round's header is bucket 0's first ``HEADER_WORDS`` int64 words: what the round
   is (``DATA``; ``REFORM``: go to the epoch named; ``CLOSE``: the publisher closes),
   the version, the epoch.
3. c10d's own timeout sits behind the longest deadline of the gang's ops: the
   publisher's are its pushes' (``op_timeout``), a subscriber's have none (it waits for
   the next push as long as it comes).
4. Each member confirms a ``DATA`` round to the publisher (rank 0) with the version
   and the epoch, two int64 (``confirmations``). The publisher posts their receives
   before the round's broadcasts (on Gloo, and FakeWorld's gangs, transfers do not
   wait for collectives): on Gloo a receive issued while the gang's pair sends a
   bucket waits for that send's end, holding the loop's thread as long (most of a
   16 MiB bucket's broadcast). On NCCL it posts them after: a communicator runs its
   ops in order, and a receive first would wait for the confirmation that the
   broadcast behind it leads to.
"""

from __future__ import annotations

from typing import Any

import torch

from agang._errors import GangError
from agang._gang import Gang
from agang._handle import Handle
from agang._weights.blocking import bound

DATA, REFORM, CLOSE = 1, 2, 3


def confirmations(
    gang: Gang, acks: list[torch.Tensor], deadline: float
) -> tuple[list[Handle[Any]], GangError | None]:
    """Rule 4: the receives of each member's confirmation into ``acks`` (member ``i``
    is rank ``i + 1``), those issued and why the next could not be, if so."""
    handles: list[Handle[Any]] = []
    try:
        for rank, ack in enumerate(acks, 1):
            handles.append(gang.recv(ack, rank, timeout=bound(deadline, 0.001)))
    except GangError as error:
        return handles, error
    return handles, None


def gang_name(channel: str, session: str, epoch: int) -> str:
    """The name of ``epoch``'s gang, the same on every member (rule 1)."""
    return f"weights:{channel}:{session}:{epoch}"
