"""The byte buffers a round moves, per bucket of the plan (``agang._weights.plan``).

Rules:
1. On the publisher, a packed bucket is a buffer of its own, filled from the tensors
   just before it is sent (``fill``); a direct bucket is the tensor's own bytes.
2. On a subscriber, by default every bucket is a buffer of its own (the staging copy:
   one extra copy of the model's bytes), and ``unpack`` copies it into the user's
   tensors when the application asks (``receive``); in place, a direct bucket is the
   user's tensor itself, and only the packed buckets are buffers (the small tensors'
   bytes), unpacked right after the round.
3. Bucket 0 starts with the round's header: ``HEADER_WORDS`` int64 words.
4. Every copy runs on the calling thread alone (``copy_bytes``): torch splits a copy
   of more than ``GRAIN`` elements over its intra-op (OpenMP) threads, and on a loaded
   machine each such copy waits for a worker that is not running: 10 to 150 ms for a
   1 MiB bucket of 64 KiB tensors on 2 busy cores, against 0.5 ms on one thread. A
   process with one intra-op thread (``torch.get_num_threads()``, asked at each copy)
   copies in one piece: torch runs it on the calling thread anyway, and the pieces'
   calls cost more than the copy's split saves (a 256 MiB sharded push made 512 of
   them, ``bench/bench_weights.py --sharded``).
5. The views each bucket's copies read and write are cut once, when the buckets are
   made (``pieces``), not at every round: cutting them cost more than copying a small
   model's bytes (a 1 KiB model of 16 tensors: about 300 us a round, most of a push).
6. A bucket still held by an op of a failed round (c10d cannot cancel it;
   a Gloo broadcast to a peer cut off by a dead link went on for seconds after its
   group's abort) gets a new buffer (``renew``) for the rounds after: the old op only
   reads (on the publisher) or writes (on a subscriber) the old memory, which nothing
   reads again, and the recovery round does not wait for it. A packed bucket costs its
   size again; a direct one, a copy per round.
7. A tied tensor (``agang._weights.plan`` rule 4) moves once; a subscriber whose own
   tensors are not tied copies it into each alias once the version is whole (``tie``).
8. A subscriber's bucket 0 has two buffers: the round's bucket 0 arrives in the spare
   (``spare0``), which is posted before the round comes and whose header is read
   first; a ``DATA`` round then swaps the two (``swap0``), each with the copies cut for
   it, instead of copying bucket 0 into staging: a model that is one bucket saved a
   copy of its bytes in every round, before the confirmation.
"""

from __future__ import annotations

import torch

from agang._weights.plan import HEADER_BYTES, HEADER_WORDS, Plan

#: The most elements torch copies on the calling thread (``at::internal::GRAIN_SIZE``).
GRAIN = 32768


def header_of(bucket0: torch.Tensor) -> torch.Tensor:
    """The round's header words at the start of ``bucket0`` (rule 3), a view."""
    return bucket0[:HEADER_BYTES].view(torch.int64)[:HEADER_WORDS]


def whole_copies() -> bool:
    """Whether this process copies in one piece: it has one intra-op thread (rule 4)."""
    return torch.get_num_threads() == 1


def copy_bytes(target: torch.Tensor, source: torch.Tensor) -> None:
    """Copies the flat uint8 ``source`` into ``target`` (as many bytes) on this thread (rule 4)."""
    if whole_copies():
        target.copy_(source)
        return
    for to, came in pieces(target, source):
        to.copy_(came)


def pieces(target: torch.Tensor, source: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The flat uint8 ``source`` and ``target`` (as many bytes) cut into pairs of views of
    at most ``GRAIN`` elements, each of the widest word both sides align to: copying each
    pair copies ``source`` on the calling thread (rule 4)."""
    dtype = next(
        dtype
        for width, dtype in _WORDS
        if source.numel() % width == 0
        and source.storage_offset() % width == 0
        and target.storage_offset() % width == 0
    )
    words_to, words_from = target.view(dtype), source.view(dtype)
    return [
        (words_to[start : start + GRAIN], words_from[start : start + GRAIN])
        for start in range(0, words_from.numel(), GRAIN)
    ]


_WORDS = [(8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8)]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a flat uint8 view of its memory."""
    return tensor.reshape(-1).view(torch.uint8)


def copy_views(into: torch.Tensor, came: torch.Tensor) -> None:
    """Copies ``came`` into ``into`` (equal shapes, either may be strided) on this thread
    alone (rule 4): as bytes where both are contiguous, else in runs of whole rows of at
    most ``GRAIN`` elements (a sharded side's strided shares)."""
    if came.numel() == 0:
        return
    if whole_copies():
        into.copy_(came)
        return
    if into.is_contiguous() and came.is_contiguous():
        copy_bytes(as_bytes(into), as_bytes(came))
        return
    step = max(1, GRAIN // max(1, came[0].numel()))
    for start in range(0, came.shape[0], step):
        length = min(step, came.shape[0] - start)
        into.narrow(0, start, length).copy_(came.narrow(0, start, length))


#: A bucket's copies (rule 5): (buffer piece, tensor piece) pairs in ``GRAIN``'s
#: pieces, and the same a pair a part (rule 4).
Copies = tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]


class Buckets:
    """The buffers of ``plan``'s buckets over ``tensors`` (rules 1, 2)."""

    def __init__(
        self, plan: Plan, tensors: dict[str, torch.Tensor], *, publisher: bool, in_place: bool
    ) -> None:
        self.plan = plan
        self.layout = plan.buckets()
        self._tensors = list(tensors.values())
        self._device = self._tensors[0].device  # every tensor's (``checks``): staging there too
        self._bytes = [as_bytes(t) if t.numel() else None for t in self._tensors]
        self.in_place = in_place
        self.wire: list[torch.Tensor] = []
        self._owned: list[bool] = []  # a buffer of its own, not the user's tensor
        for direct, nbytes, parts in self.layout:
            if direct and (publisher or in_place):
                index, _, size, start = parts[0]
                view = self._bytes[index]
                assert view is not None
                self.wire.append(view[start : start + size])
                self._owned.append(False)
            else:
                self.wire.append(torch.zeros(nbytes, dtype=torch.uint8, device=self._device))
                self._owned.append(True)
        # Rule 5: each bucket's copies, (buffer piece, tensor piece) pairs, as GRAIN's
        # pieces and whole (rule 4); none for a bucket that is the user's tensor itself.
        self._pieces = [
            self._cut(index, wire) if owned else ([], [])
            for index, (wire, owned) in enumerate(zip(self.wire, self._owned, strict=True))
        ]
        # Rule 8: a subscriber's bucket 0 comes into a spare buffer, swapped in.
        self.spare0 = torch.zeros(0, dtype=torch.uint8, device=self._device)
        self._spare_pieces: Copies = ([], [])
        if not publisher:
            assert self._owned[0], "bucket 0 carries the header: a buffer of its own"
            self.renew_spare0()
        # Rule 7: (the tensor's bytes, an alias's own bytes) where they are two memories.
        self._ties: list[tuple[torch.Tensor, torch.Tensor]] = []
        for alias, first in plan.ties().items():
            source, target = self._bytes[first], self._bytes[alias]
            if source is not None and target is not None and source.data_ptr() != target.data_ptr():
                self._ties.append((source, target))

    @property
    def staging_bytes(self) -> int:
        """The bytes this side holds beyond the user's tensors."""
        return sum(w.numel() for w, owned in zip(self.wire, self._owned, strict=True) if owned)

    def _cut(self, index: int, wire: torch.Tensor) -> Copies:
        """Bucket ``index``'s copies between ``wire``, a buffer of its own, and the
        tensors (rule 5): in ``GRAIN``'s pieces, and a pair a part (rule 4)."""
        cut: list[tuple[torch.Tensor, torch.Tensor]] = []
        whole: list[tuple[torch.Tensor, torch.Tensor]] = []
        for tensor_index, offset, size, start in self.layout[index][2]:
            tensor_bytes = self._bytes[tensor_index]
            assert tensor_bytes is not None
            pair = (wire[offset : offset + size], tensor_bytes[start : start + size])
            cut += pieces(*pair)
            whole.append(pair)
        return cut, whole

    def _copies(self, index: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Bucket ``index``'s copies as this process copies now (rule 4)."""
        cut, whole = self._pieces[index]
        return whole if whole_copies() else cut

    def renew(self, index: int) -> None:
        """Gives bucket ``index`` a new buffer of its own, filled like a packed one from
        then on (rule 6). The old buffer (or tensor) is left to the op that holds it."""
        wire = torch.zeros(self.layout[index][1], dtype=torch.uint8, device=self._device)
        self.wire[index] = wire
        self._owned[index] = True
        self._pieces[index] = self._cut(index, wire)

    def renew_spare0(self) -> torch.Tensor:
        """A new spare for bucket 0 (rules 6, 8), returned; the old one is left to the
        op that holds it."""
        self.spare0 = torch.zeros_like(self.wire[0])
        self._spare_pieces = self._cut(0, self.spare0)
        return self.spare0

    def swap0(self) -> torch.Tensor:
        """Makes the spare, which holds the round's bucket 0, the staging's bucket 0,
        and the staging's the spare, returned (rule 8): the caller holds the staging
        lock, and no op holds either buffer."""
        self.wire[0], self.spare0 = self.spare0, self.wire[0]
        self._pieces[0], self._spare_pieces = self._spare_pieces, self._pieces[0]
        return self.spare0

    def fill(self, index: int) -> None:
        """Copies the tensors of bucket ``index`` into its buffer, where it has one of its
        own (rule 1)."""
        for to, came in self._copies(index):
            to.copy_(came)

    def unpack_bucket(self, index: int) -> None:
        """Copies bucket ``index`` into the user's tensors, where it is a buffer of its
        own (rule 2)."""
        for came, to in self._copies(index):
            to.copy_(came)

    def unpack(self) -> None:
        """Copies every bucket that is a buffer of its own into the user's tensors, then
        the tied ones into their aliases (rules 2, 7)."""
        for index in range(len(self.wire)):
            self.unpack_bucket(index)
        self.tie()

    def tie(self) -> None:
        """Copies each tied tensor into its alias, where the alias is a memory of its own
        (rule 7)."""
        for source, target in self._ties:
            copy_bytes(target, source)
