"""The plan of a channel: which tensors move, in which order, with which shapes and
dtypes, agreed by both sides before any byte moves; and how they are cut into buckets.

Rules:
1. The plan is the tensors' names, in order, each with its dtype and shape. Its
   fingerprint is a hash of exactly that text: two plans move the same bytes to the
   same places if and only if their fingerprints are equal.
2. The publisher writes its plan (and bucket size) to the store; a subscriber whose own
   plan differs is refused at ``open``, with the first differing tensor named on both
   sides (``difference``).
3. Buckets: tensors are taken in plan order; one of at least ``bucket_bytes`` bytes
   moves in a *direct* bucket (its bytes move as they are, with no copy on a publisher
   that holds it whole), or, in a *split* plan, in direct buckets of at most
   ``bucket_bytes`` each, cut between rows of its first dimension (``row_bytes``: a row
   larger than ``bucket_bytes`` is a bucket of its own); the others are *packed* into
   buckets of up to ``bucket_bytes``, each tensor at an offset aligned to ``ALIGN``
   bytes. Cutting between rows of dimension 0 is what lets a sharded side
   (``agang._weights.sharding``) move its share of a bucket as one view: a row range of
   a ``Shard(0)`` tensor, or whole rows of a ``Shard(d)`` one; and in a split plan no
   bucket is larger than ``bucket_bytes`` (but for such a row), so a side that streams
   buckets holds a few, never the largest tensor. A sharded trainer's publisher splits
   its plan; whether a plan is split is part of the stored plan (not of the
   fingerprint), so every side cuts it alike. Bucket 0 is always packed and starts with
   the round's header (``HEADER_BYTES``). A model that fits one bucket (its header
   aside: a model of exactly ``bucket_bytes`` is one round trip, not two) moves whole in
   bucket 0, in one broadcast, which a subscriber posts before the round comes;
   otherwise bucket 0 holds at most ``FIRST_BUCKET_BYTES`` (a subscriber receives it
   apart, reads the header, then posts the other buckets). Empty tensors move nothing.
   Both sides derive the same buckets from the same plan and bucket size.
4. *Tied tensors.* A tensor under several names (a tied embedding's ``state_dict()``:
   one tensor, the same view, twice) moves once, under its first name; the later names
   are its *aliases* and move nothing. The aliases are part of the stored plan but not
   of the fingerprint: a subscriber whose tensors are not tied gets the bytes copied
   into each name's tensor; one that ties names the publisher does not is refused at
   ``open`` (one tensor cannot hold two values). Two names whose memory overlaps
   without being the same view are refused too: no order of copies keeps both.
5. *One transport per channel*: the publisher's (``agang._weights.site``: NCCL for
   tensors on a GPU, the simulated NCCL's own for CPU tensors under
   ``AGANG_SIM_NCCL=1``, Gloo for other CPU tensors) is part of the stored plan, and a
   subscriber whose tensors would take another is refused at ``open``, naming both
   sides' devices.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from dataclasses import dataclass

import torch

#: The round's header at the start of bucket 0 (int64 words: what, version, epoch, spare).
HEADER_WORDS = 4
HEADER_BYTES = 64
ALIGN = 64
DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024
#: The default over a trainer gang (``agang._weights.gathering``): a bucket there costs
#: two ops, the ranks' shares gathered and then the broadcast, with the wake-ups between,
#: where a single publisher's costs one; the sender's memory stays a few buckets. In
#: three runs each of `bench_weights.py --sharded --bucket-bytes B 16777216 67108864`,
#: alternating (2-core machine, 2026-11-29), a 64 MiB push took 1.30-1.45x the hand-made
#: gather-and-broadcast with 4 MiB buckets and 1.08-1.12x with 16 MiB (16 MiB models:
#: 1.43-1.54x and 1.35-1.39x).
GANG_BUCKET_BYTES = 16 * 1024 * 1024
#: The most bytes of bucket 0 where the model needs more than one bucket: a subscriber
#: receives it apart (its header says what the round is), posts the other buckets'
#: receives, then copies it. 4 MiB left
#: a 16 MiB push waiting on it; with 1 MiB, in two alternating runs of `bench_weights.py
#: --quick 1048576 16777216` (2-core machine, 2026-11-26), 16 MiB pushes took 8.2-14.5 ms
#: against 9.4-17.8 ms with 64 KiB, and 1 MiB pushes the same (1.5-3.3 ms).
FIRST_BUCKET_BYTES = 1024 * 1024

#: A part of a bucket: (the tensor's index, offset in the bucket, bytes, offset in the
#: tensor's bytes).
Part = tuple[int, int, int, int]
#: A bucket: (direct, its bytes, its parts) (rule 3).
Bucket = tuple[bool, int, list[Part]]


def _aligned(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Plan:
    """The tensors' names, dtypes and shapes in order (rule 1), and the buckets they move
    in (rule 3): each bucket is ``(direct, nbytes, [Part, ...])``."""

    entries: tuple[tuple[str, str, tuple[int, ...]], ...]
    sizes: tuple[int, ...]
    bucket_bytes: int
    #: Per tensor, the index of the first tensor it is (itself where it is not tied).
    aliases: tuple[int, ...] = ()
    #: What moves the bytes, ``"gloo"``, ``"nccl"`` or ``"nccl-sim"`` (the simulated NCCL):
    #: one per channel (rule 5); not part
    #: of the fingerprint, which says what moves, not how.
    transport: str = "gloo"
    #: Whether direct buckets are cut at ``bucket_bytes`` (rule 3): stored, not part of
    #: the fingerprint.
    split: bool = False

    def __post_init__(self) -> None:
        if not self.aliases:
            object.__setattr__(self, "aliases", tuple(range(len(self.entries))))

    @classmethod
    def of(
        cls,
        tensors: dict[str, torch.Tensor],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        transport: str = "gloo",
        memory: dict[str, torch.Tensor] | None = None,
        split: bool = False,
    ) -> Plan:
        """The plan of ``tensors`` (their global shapes, where they are ``DTensor``s);
        ``memory``, the same names' tensors whose memory says which are tied (rule 4):
        a sharded side's local shards (None: ``tensors`` themselves)."""
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int):
            raise TypeError(f"`bucket_bytes` must be an int, but is {bucket_bytes!r}.")
        if bucket_bytes < 1024:
            raise ValueError(f"`bucket_bytes` must be at least 1024, but is {bucket_bytes}.")
        entries = tuple(
            (name, str(t.dtype).removeprefix("torch."), tuple(t.shape))
            for name, t in tensors.items()
        )
        sizes = tuple(t.numel() * t.element_size() for t in tensors.values())
        return cls(entries, sizes, bucket_bytes, _aliases(memory or tensors), transport, split)

    @property
    def fingerprint(self) -> str:
        """Rule 1: a hash of the names, order, dtypes and shapes."""
        return hashlib.sha256(self._describe_all().encode()).hexdigest()[:32]

    def _describe_all(self) -> str:
        return "\n".join(self.describe(i) for i in range(len(self.entries)))

    def describe(self, index: int) -> str:
        """Tensor ``index`` as "'name' dtype[shape]"."""
        name, dtype, shape = self.entries[index]
        return f"'{name}' {dtype}[{', '.join(map(str, shape))}]"

    @property
    def nbytes(self) -> int:
        """The bytes one version moves (a tied tensor once: rule 4)."""
        return sum(size for i, size in enumerate(self.sizes) if self.aliases[i] == i)

    def ties(self) -> dict[int, int]:
        """Each alias's index, and the index of the tensor it is (rule 4)."""
        return {i: first for i, first in enumerate(self.aliases) if first != i}

    def to_text(self) -> str:
        """The plan as the store keeps it (rule 2)."""
        return json.dumps(
            {
                "fingerprint": self.fingerprint,
                "bucket_bytes": self.bucket_bytes,
                "tensors": [[n, d, list(s)] for n, d, s in self.entries],
                "sizes": list(self.sizes),
                "aliases": list(self.aliases),
                "transport": self.transport,
                "split": self.split,
            }
        )

    @classmethod
    def from_text(cls, text: str) -> Plan:
        data = json.loads(text)
        entries = tuple((str(n), str(d), tuple(int(x) for x in s)) for n, d, s in data["tensors"])
        aliases = tuple(int(x) for x in data.get("aliases", ()))
        plan = cls(
            entries,
            tuple(int(x) for x in data["sizes"]),
            int(data["bucket_bytes"]),
            aliases,
            str(data.get("transport", "gloo")),
            bool(data.get("split", False)),
        )
        if plan.fingerprint != data["fingerprint"]:
            raise ValueError("the stored plan does not match its own fingerprint")
        return plan

    def difference(
        self, theirs: Plan, *, mine: str = "here", other: str = "the publisher's"
    ) -> str | None:
        """None where the plans match (rule 1), else a sentence naming the first tensor
        that differs, on both sides (rule 2)."""
        if self.fingerprint == theirs.fingerprint:
            for alias, first in self.ties().items():  # rule 4
                if theirs.aliases[alias] != theirs.aliases[first]:
                    return (
                        f"{self.describe(alias)} and {self.describe(first)} are one tensor "
                        f"{mine}, and two in {other} plan (a tensor cannot hold two values)"
                    )
            return None
        for index, (a, b) in enumerate(zip(self.entries, theirs.entries, strict=False)):
            if a != b:
                return (
                    f"tensor #{index} is {self.describe(index)} {mine}, and "
                    f"{theirs.describe(index)} in {other} plan"
                )
        longer = self if len(self.entries) > len(theirs.entries) else theirs
        shorter = theirs if longer is self else self
        extra = longer.describe(len(shorter.entries))
        where = mine if longer is self else f"in {other} plan"
        return (
            f"{mine} {len(self.entries)} tensors, {other} plan {len(theirs.entries)}: the "
            f"first without a counterpart is tensor #{len(shorter.entries)}, {extra} {where}"
        )

    def buckets(self) -> list[Bucket]:
        """Rule 3: ``(direct, nbytes, [(index, offset, nbytes, tensor_offset), ...])`` per
        bucket; bucket 0 is packed, its first ``HEADER_BYTES`` the header. Cut once per
        plan (a model of thousands of buckets is cut in milliseconds, not once a bucket);
        the list is shared: do not change it."""
        return self._buckets

    @functools.cached_property
    def _buckets(self) -> list[Bucket]:
        whole = self._cut(HEADER_BYTES + self.bucket_bytes)
        if len(whole) == 1:  # rule 3: the whole model in bucket 0, past its header
            return whole
        return self._cut(min(self.bucket_bytes, FIRST_BUCKET_BYTES))

    def row_bytes(self, index: int) -> int:
        """The bytes of one row of tensor ``index``'s first dimension (of a 0-d one: all
        of it): direct buckets are cut between rows (rule 3)."""
        shape = self.entries[index][2]
        rows = shape[0] if shape else 1
        return self.sizes[index] // rows if rows else 0

    def _cut(self, first_limit: int) -> list[Bucket]:
        """The buckets, bucket 0 holding at most ``first_limit`` bytes."""
        packed: list[Part] = []
        offset = HEADER_BYTES
        out: list[Bucket] = []
        direct: list[Bucket] = []
        first = True

        def close_packed() -> None:
            nonlocal packed, offset, first
            out.append((False, offset, packed))
            packed, offset, first = [], 0, False

        for index, size in enumerate(self.sizes):
            if size == 0 or self.aliases[index] != index:  # rule 4: moves under its first
                continue
            if size >= self.bucket_bytes:
                row = self.row_bytes(index)
                step = max(1, self.bucket_bytes // row) * row if self.split else size
                for start in range(0, size, step):
                    nbytes = min(step, size - start)
                    direct.append((True, nbytes, [(index, 0, nbytes, start)]))
                continue
            start = _aligned(offset)
            limit = first_limit if first else self.bucket_bytes
            if (packed or first) and start + size > limit:
                close_packed()
                start = 0
            packed.append((index, start, size, 0))
            offset = start + size
        if packed or first:
            close_packed()
        # Packed buckets first (bucket 0 carries the header), then the direct ones.
        return out + direct


def _aliases(tensors: dict[str, torch.Tensor]) -> tuple[int, ...]:
    """Per tensor, the index of the first of ``tensors`` that is the same view of the
    same memory (itself where none is); raises ``ValueError`` for two whose memory
    overlaps otherwise (rule 4)."""
    names = list(tensors)
    first_of: dict[tuple[object, ...], int] = {}
    aliases: list[int] = []
    spans: list[tuple[int, int, int]] = []  # (start, end, index) of each first
    for index, tensor in enumerate(tensors.values()):
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            aliases.append(index)
            continue
        start = tensor.data_ptr()
        key = (start, nbytes, tensor.dtype, tuple(tensor.shape))
        aliases.append(first_of.setdefault(key, index))
        if aliases[-1] == index:
            spans.append((start, start + nbytes, index))
    spans.sort()
    for (_, end, a), (start, _, b) in itertools.pairwise(spans):
        if start < end:
            first, second = sorted((a, b))
            raise ValueError(
                f"`tensors['{names[first]}']` and `tensors['{names[second]}']` overlap in "
                f"memory without being the same tensor: pass them as separate tensors (a "
                f"copy), or one tensor under both names."
            )
    return tuple(aliases)
