"""The publisher's housekeeping of the store: which keys no one will read again, and
deleting them (``agang._weights.channel`` rule 6), so that a channel that runs for weeks,
its servers coming and going, holds as many keys at the end as at the start.

Rules:
1. *Epochs.* Every epoch the publisher writes is noted with its size. Once a later
   epoch's group is made (or a later epoch has no subscriber, so no group), the earlier
   ones are dead: a member that has not moved on finds the newer epoch and leaves them.
   Their keys go. At close, every epoch's keys go, and every dropped subscriber's.
2. *Subscribers.* One that left has its keys deleted when its leave is read. One that
   was dropped keeps its drop (it reads it to register again, or to learn it was
   replaced) until ``DROPS_KEPT`` later drops have passed; then its drop goes, and its
   beat and mailbox too unless it registered again since. One that registers again
   after a drop has the drop deleted at once: it read it.
3. Every method talks to the store and may block: call them off the event loop. The
   publisher's fleet (its own thread) and its pushes (theirs) both call them: a lock
   keeps the notes whole.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import final

from agang._weights.channel import DROPS_KEPT, Channel


@final
class Housekeeping:
    """Notes what the publisher wrote for whom, and deletes what is dead (module rules)."""

    def __init__(self, channel: Channel, group_keys: Callable[[int], list[str]]) -> None:
        self._channel = channel
        self._group_keys = group_keys  # the rendezvous keys of a group of a size
        self._lock = threading.Lock()
        self._epochs: dict[int, int] = {}  # epoch -> size, whose keys are in the store
        self._drops: OrderedDict[str, None] = OrderedDict()  # dropped uids, oldest first

    def wrote_epoch(self, epoch: int, size: int) -> None:
        """``epoch``'s members (``size`` with the publisher) were written (rule 1)."""
        with self._lock:
            self._epochs[epoch] = size

    def epoch_made(self, epoch: int) -> None:
        """``epoch``'s group was made, or needs none: the epochs before it are dead."""
        with self._lock:
            for old in [e for e in self._epochs if e < epoch]:
                size = self._epochs.pop(old)
                self._channel.forget_epoch(old, self._group_keys(size))

    def closing(self) -> None:
        """The publisher closes: every epoch's keys go, and every dropped subscriber's
        (each learns from the channel's ``closed`` that it is over; rules 1, 2)."""
        with self._lock:
            for epoch, size in list(self._epochs.items()):
                self._channel.forget_epoch(epoch, self._group_keys(size))
            self._epochs.clear()
            while self._drops:
                self._channel.forget(self._drops.popitem(last=False)[0])
        self._channel.sweep_late_answers()

    def dropped(self, uid: str, why: str, alive: set[str]) -> None:
        """Drops ``uid`` with ``why`` (it reads it) and forgets the oldest drop past
        ``DROPS_KEPT``; ``alive``: the uids registered or admitted now, whose beat and
        mailbox stay (rule 2)."""
        with self._lock:
            self._channel.drop(uid, why)
            self._drops.pop(uid, None)
            self._drops[uid] = None
            while len(self._drops) > DROPS_KEPT:
                oldest, _ = self._drops.popitem(last=False)
                if oldest in alive:
                    self._channel.forget_drop(oldest)
                else:
                    self._channel.forget(oldest)

    def registered(self, uid: str) -> None:
        """``uid`` registered: a drop of its, read, goes (rule 2)."""
        with self._lock:
            if uid in self._drops:
                del self._drops[uid]
                self._channel.forget_drop(uid)

    def left(self, uid: str) -> None:
        """``uid`` closed: every key of its goes (rule 2)."""
        with self._lock:
            self._drops.pop(uid, None)
            self._channel.forget(uid)
