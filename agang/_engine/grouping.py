"""Deterministic coalescing's pure part: grouping by program order, flat buffers.

The scopes and the issuing are ``coalescer``'s; these are its rules.

Rules:
1. *Program order only.* Grouping depends on the calls and their arguments in program
   order, never on timing: two ranks that make the same calls group them the same way,
   however their loops are scheduled (a timing-based batcher would deadlock them).
2. *Groups.* A group holds all-reduces with the same reduce op, dtype and device.
   Groups are issued in the order of their first member; within a group, members keep
   call order.
3. *Buckets.* Buckets (``all_reduce_bucketed``) are groups with a size cap, filled in
   list order, one open bucket per dtype and device: a bucket is issued once the next
   tensor would take it past the cap; a tensor larger than the cap is a bucket of its
   own.
4. *Flat ops.* A flat op copies its members into one buffer when it is issued, reduces
   the buffer, and copies each member's part back before its handle finishes
   (stream-ordered on CUDA). A group of one reduces the member in place, with no copy.
5. *Scopes.* A ``coalesce()`` scope belongs to the task (or thread) that opened it;
   other tasks' calls on the gang pass straight through. Nested scopes join the
   outermost one.
6. *Other ops flush.* Inside a scope, any op other than ``all_reduce`` first issues
   what the scope holds, so program order is kept across kinds of op.
7. *No wait inside.* Awaiting a held member inside its open scope raises at once: it
   could never finish.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import final

import torch

from agang._engine import busy
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
    """A new 1-D buffer holding the (contiguous) ``tensors``' elements in order (tensors
    outside autograd: detached, or under ``FlatBuffers.pack``'s no-grad mode)."""
    # A view costs microseconds from Python: 1-D tensors (biases, norms, flat buffers)
    # are concatenated as they are, and views of the others are made in C++.
    if all(t.dim() == 1 for t in tensors):
        return torch.cat(tensors)
    return torch._C._nn.flatten_dense_tensors(tensors)


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copies ``flat``'s consecutive parts back into ``tensors`` (contiguous; outside
    autograd, as for ``flatten``)."""
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

    @torch.no_grad()  # members may require grad; the buffer carries values only
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

    @torch.no_grad()  # results go into members that may require grad, as c10d's do
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


@dataclass(eq=False, slots=True)
class Member:
    """An all-reduce held in a scope until the scope ends."""

    tensor: torch.Tensor
    op: ReduceOp
    dtype: torch.dtype
    seconds: float | None  # the resolved timeout: None means no deadline
    handle: Handle[torch.Tensor]
    claim: busy.Claim


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
