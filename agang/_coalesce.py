"""Deterministic coalescing: many all-reduces as a few flat ones, by program order only.

Rules:
1. Grouping depends on the calls and their arguments in program order, never on
   timing: two ranks that make the same calls group them the same way, however their
   loops are scheduled (a timing-based batcher would deadlock them).
2. A group holds all-reduces with the same reduce op, dtype and device. Groups are
   issued in the order of their first member; within a group, members keep call order.
3. Buckets (``all_reduce_bucketed``) are groups with a size cap, filled in list order,
   one open bucket per dtype and device: a bucket is issued once the next tensor would
   take it past the cap; a tensor larger than the cap is a bucket of its own.
4. A flat op copies its members into one buffer when it is issued, reduces the buffer,
   and copies each member's part back before its handle finishes (stream-ordered on
   CUDA). A group of one reduces the member in place, with no copy.
5. A ``coalesce()`` scope belongs to the task (or thread) that opened it; other tasks'
   calls on the gang pass straight through. Nested scopes join the outermost one.
6. Inside a scope, any op other than ``all_reduce`` first issues what the scope holds,
   so program order is kept across kinds of op.
7. Awaiting a held member inside its open scope raises at once: it could never finish.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Generator, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, final

import torch

from agang import _busy
from agang._handle import Handle
from agang._reduce_op import ReduceOp


def plan_buckets(items: Sequence[tuple[Hashable, int]], cap: int | None) -> list[list[int]]:
    """Groups item indexes by key in list order; ``cap`` bytes per bucket (rules 2, 3).

    Args:
        items: ``(key, num_bytes)`` per item; only equal keys share a bucket.
        cap: The most bytes a bucket may hold, or None for one group per key.

    Returns:
        The buckets, as lists of indexes, in the order they are to be issued.
    """
    done: list[tuple[int, list[int]]] = []  # (index of first member, members)
    open_buckets: dict[Hashable, tuple[list[int], int]] = {}
    for index, (key, num_bytes) in enumerate(items):
        members, total = open_buckets.get(key, ([], 0))
        if members and cap is not None and total + num_bytes > cap:
            done.append((members[0], members))
            members, total = [], 0
        members.append(index)
        open_buckets[key] = (members, total + num_bytes)
    # A bucket that reached its cap is issued then, before the buckets still open at
    # the end, which follow in the order of their first member.
    done.extend(sorted((members[0], members) for members, _ in open_buckets.values()))
    return [members for _, members in done]


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A new 1-D buffer holding the (contiguous) ``tensors``' elements in order."""
    # A view costs microseconds from Python: 1-D tensors (biases, norms, flat buffers)
    # are concatenated as they are, and views of the others are made in C++.
    if all(t.dim() == 1 for t in tensors):
        return torch.cat(tensors)
    return torch._C._nn.flatten_dense_tensors(tensors)


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copies ``flat``'s consecutive parts back into ``tensors`` (contiguous)."""
    targets = [t if t.dim() == 1 else t.view(-1) for t in tensors]
    torch._foreach_copy_(targets, flat.split_with_sizes([t.numel() for t in targets]))


Shapes = tuple[torch.Size, ...]


@final
class Packed:
    """A flat op's buffer: its members' elements, one after another."""

    __slots__ = ("flat", "flat_members", "key", "parts")

    def __init__(self, flat: torch.Tensor, flat_members: bool, key: object) -> None:
        self.flat = flat
        self.flat_members = flat_members  # every member is 1-D
        # Views of ``flat`` shaped like the members, made when first needed.
        self.parts: list[torch.Tensor] | None = None
        self.key = key


class FlatBuffers:
    """Packs a flat op's members into one buffer and copies the result back (rule 4),
    reusing the buffers of finished CPU ops.

    A new buffer of a few hundred KiB comes from fresh pages, and filling it costs a
    page fault per 4 KiB (microseconds each on a VM); a kept buffer's pages are mapped
    already, and its parts (views shaped like the members, which cost microseconds each
    to make from Python) are kept with it. At most one buffer per (dtype, member shapes)
    and ``max_bytes`` in all are kept; CUDA memory is left to torch's caching allocator.
    """

    def __init__(self, max_bytes: int = 64 * 2**20) -> None:
        self._lock = threading.Lock()
        self._kept: dict[object, Packed] = {}
        self._bytes = 0
        self._max_bytes = max_bytes

    def pack(self, tensors: list[torch.Tensor]) -> Packed:
        """The members copied into a kept buffer of their layout, or a new one."""
        first = tensors[0]
        key = None
        if first.device.type == "cpu":
            key = (first.dtype, tuple([t.shape for t in tensors]))
            with self._lock:
                packed = self._kept.pop(key, None)
                if packed is not None:
                    self._bytes -= packed.flat.nbytes
            if packed is not None:
                if packed.flat_members:
                    torch.cat(tensors, out=packed.flat)
                else:
                    assert packed.parts is not None
                    torch._foreach_copy_(packed.parts, tensors)
                return packed
        return Packed(flatten(tensors), all(t.dim() == 1 for t in tensors), key)

    def unpack(self, packed: Packed, tensors: list[torch.Tensor]) -> None:
        """Copies the reduced buffer back into the members; the buffer may then be
        reused (call it only once c10d is done with the buffer)."""
        if packed.parts is None:
            parts = list(packed.flat.split_with_sizes([t.numel() for t in tensors]))
            for i, tensor in enumerate(tensors):
                if tensor.dim() != 1:
                    parts[i] = parts[i].view(tensor.shape)
            packed.parts = parts
        torch._foreach_copy_(tensors, packed.parts)
        if packed.key is None:
            return
        nbytes = packed.flat.nbytes
        with self._lock:
            if packed.key not in self._kept and self._bytes + nbytes <= self._max_bytes:
                self._kept[packed.key] = packed
                self._bytes += nbytes

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()
            self._bytes = 0


def current_owner() -> object:
    """The task (asyncio or trio) or, outside any loop, the thread running now."""
    loop = asyncio._get_running_loop()
    if loop is not None:
        return asyncio.current_task(loop)
    try:
        import trio

        return trio.lowlevel.current_task()
    except (ImportError, RuntimeError):
        return threading.get_ident()


@dataclass(eq=False, slots=True)
class Member:
    """An all-reduce held in a scope until the scope ends."""

    tensor: torch.Tensor
    op: ReduceOp
    dtype: torch.dtype
    timeout: float | None  # resolved: None means no deadline
    handle: Handle[torch.Tensor]
    claim: _busy.Claim


@final
class Coalesced:
    """What a ``coalesce()`` scope issued: await it for all its tensors at once.

    Each held all-reduce also has its own handle (:attr:`handles`); awaiting this object
    instead costs one wake-up for the whole scope.

    Example:
        >>> with gang.coalesce() as batch:
        ...     for grad in grads:
        ...         gang.all_reduce(grad)
        >>> await batch  # every grad reduced, in place
    """

    def __init__(self) -> None:
        #: The handles of the scope's all-reduces, in call order.
        self.handles: list[Handle[torch.Tensor]] = []
        self._tensors: list[torch.Tensor] = []
        self._flats: list[Handle[list[torch.Tensor]]] = []  # the flat ops, as issued
        self._all: Handle[list[torch.Tensor]] | None = None

    def _issued(self) -> Handle[list[torch.Tensor]]:
        if self._all is None:
            raise RuntimeError(HELD)
        return self._all

    def __await__(self) -> Generator[Any, None, list[torch.Tensor]]:
        return self._issued().__await__()

    def wait(self, timeout: float | None = None) -> list[torch.Tensor]:
        """Blocks until every all-reduce of the scope finished; their tensors."""
        return self._issued().wait(timeout)


@dataclass(eq=False)
class Scope:
    """One open ``coalesce()`` scope of one owner on one gang."""

    owner: object
    depth: int = 1
    members: list[Member] = field(default_factory=list)
    issued: Coalesced = field(default_factory=Coalesced)

    def take(self) -> list[Member]:
        members, self.members = self.members, []
        return members


HELD = (
    "This all_reduce is held by the open `coalesce()` scope that issued it and starts "
    "when the scope ends; await it after the `with` block."
)


def group_members(members: Sequence[Member]) -> list[list[Member]]:
    """The scope's members in flat groups (rule 2): ``plan_buckets`` with no cap,
    written out because it runs for every scope. Every member is on the gang's device."""
    if not members:
        return []
    first = members[0]
    op, dtype = first.op, first.dtype
    if all(m.op is op and m.dtype is dtype for m in members):
        return [list(members)]  # the common case, without a dict
    groups: dict[tuple[ReduceOp, torch.dtype], list[Member]] = {}
    for member in members:
        groups.setdefault((member.op, member.dtype), []).append(member)
    return list(groups.values())


def group_timeout(timeouts: Sequence[float | None]) -> float | None:
    """The tightest deadline of a group's members; None when none has one."""
    finite = [t for t in timeouts if t is not None]
    return min(finite) if finite else None


def failed(op: str, error: BaseException) -> Handle[Any]:
    """A handle that has already failed: for an op that could not be issued."""
    handle: Handle[Any] = Handle(op=op, seq=-1, num_bytes=0, timeout=None)
    handle._finish(None, error)
    return handle


def all_of(handles: Sequence[Handle[Any]], value: Any, *, op: str) -> Handle[Any]:
    """A handle that finishes with ``value`` once all ``handles`` have, or with the first
    error among them (in order)."""
    combined: Handle[Any] = Handle(
        op=op,
        seq=handles[0].seq if handles else -1,
        num_bytes=sum(h.num_bytes for h in handles),
        timeout=group_timeout([h.timeout for h in handles]),
    )
    combined._before_wait = handles[0]._before_wait if handles else None
    if not handles:
        combined._finish(value, None)
        return combined
    lock = threading.Lock()
    remaining = [len(handles)]

    def one_done() -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        errors = [h.exception() for h in handles if h.exception() is not None]
        combined._finish(None if errors else value, errors[0] if errors else None)

    for handle in handles:
        handle._add_done_callback(one_done)
    return combined
