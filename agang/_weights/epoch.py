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
"""

from __future__ import annotations

DATA, REFORM, CLOSE = 1, 2, 3


def gang_name(channel: str, session: str, epoch: int) -> str:
    """The name of ``epoch``'s gang, the same on every member (rule 1)."""
    return f"weights:{channel}:{session}:{epoch}"
