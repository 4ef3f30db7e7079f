"""How a gang holds each tensor of a channel's plan: whole on every rank, or split along
one dimension; and which part of a bucket each rank holds.

Rules:
1. *A layout per tensor.* A ``DTensor`` on a 1-D mesh of the gang's ranks (mesh
   coordinate = gang rank) with ``Shard(d)`` is split along ``d`` as ``torch.chunk``
   splits it (FSDP2's and tensor parallelism's split: ``ceil(n / w)`` rows each, the
   last ranks the rest or none: the sizes and offsets that
   ``Shard.local_shard_size_and_offset`` gives, which the tests check); an
   [`agang.Sharded`][agang.Sharded] says the same of a plain tensor. ``Replicate()`` and
   plain tensors are held whole by every rank; a gang's sender takes them from rank 0
   (plain tensors are assumed equal on every rank: checking it would cost a pass over
   the bytes).
2. *What is refused, and why* (each error names the tensor): ``Partial()`` (its value
   is a sum not taken yet), ``_StridedShard`` and meshes of two or more dimensions
   (FSDP with tensor parallelism, HSDP: a rank's share is not one block), a mesh that
   is not the gang (its size, or this rank's place in it, differ), and a local tensor
   whose shape is not its share of the global one.
3. *Shares of a bucket.* A plan cuts tensors between rows of their first dimension
   (``agang._weights.plan`` rule 3), so a part of a bucket is rows ``[r0, r1)`` of a
   tensor. A rank's share of it is one block: for ``Shard(0)``, the rows it holds
   (contiguous on both sides: it moves with no copy); for ``Shard(d)``, ``d >= 1``,
   columns ``[offset, offset + size)`` of dimension ``d`` of those rows (contiguous in
   the local tensor, strided in the bucket: one strided copy); held whole, all of it.
4. No import of ``torch.distributed.tensor``: a ``DTensor`` can exist only once that
   module was loaded, so where it was not, no value is one.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from agang._weights.sharded import Sharded


@dataclass(frozen=True)
class Layout:
    """One tensor as a gang holds it (rule 1): this rank's ``local`` tensor (contiguous),
    the global ``shape``, and along ``dim`` (None: held whole) each rank's
    ``(offset, size)``."""

    local: torch.Tensor
    shape: tuple[int, ...]
    dim: int | None
    spans: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, name: str, value: object, rank: int, size: int) -> Layout:
        """The layout of ``tensors[name]`` on ``rank`` of a gang of ``size`` (rules 1, 2)."""
        if isinstance(value, Sharded):
            return cls._split(name, value.tensor, value.shape, value.dim, rank, size, "")
        dtensor = _dtensor_class()
        if dtensor is not None and isinstance(value, dtensor):
            return cls._of_dtensor(name, value, rank, size)
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"`tensors['{name}']` must be a tensor, a DTensor or an agang.Sharded, but "
                f"is of type `{type(value).__name__}` instead."
            )
        return cls(value, tuple(value.shape), None)

    @classmethod
    def _of_dtensor(cls, name: str, value: object, rank: int, size: int) -> Layout:
        mesh = value.device_mesh  # type: ignore[attr-defined]
        placements = tuple(value.placements)  # type: ignore[attr-defined]
        shown = f"`tensors['{name}']` (a DTensor with placements {placements})"
        if mesh.ndim != 1:
            raise ValueError(
                f"{shown} is on a {mesh.ndim}-D mesh; agang moves DTensors of a 1-D mesh "
                f"only (FSDP or tensor parallelism alone): a rank's share of a tensor on "
                f"a mesh of more dimensions is not one block."
            )
        if mesh.size() != size or mesh.get_local_rank() != rank:
            raise ValueError(
                f"{shown} is on a mesh of {mesh.size()} ranks where this process is "
                f"coordinate {mesh.get_local_rank()}, but the gang has {size} ranks and "
                f"this is its rank {rank}: the mesh must be the gang's ranks, in order."
            )
        placement = placements[0]
        kind = type(placement).__name__
        local = value.to_local()  # type: ignore[attr-defined]
        shape = tuple(value.shape)  # type: ignore[attr-defined]
        if kind == "Replicate":
            return cls(local, shape, None)
        if kind == "Shard":
            return cls._split(name, local, shape, placement.dim, rank, size, f" ({kind})")
        why = (
            "its value is a sum over the ranks not taken yet: call .full_tensor() or "
            "redistribute it to Shard or Replicate first"
            if kind == "Partial"
            else "a rank's share under it is not one block"
        )
        raise ValueError(f"{shown}: agang cannot move a {kind} placement: {why}.")

    @classmethod
    def _split(
        cls,
        name: str,
        local: torch.Tensor,
        shape: tuple[int, ...],
        dim: int,
        rank: int,
        size: int,
        kind: str,
    ) -> Layout:
        if not 0 <= dim < len(shape):
            raise ValueError(
                f"`tensors['{name}']` is split along dimension {dim}, which its global "
                f"shape {shape} does not have."
            )
        spans = []
        for each in range(size):
            held, offset = _chunk(shape[dim], size, each)
            spans.append((offset, held))
        expected = (*shape[:dim], spans[rank][1], *shape[dim + 1 :])
        if tuple(local.shape) != expected:
            raise ValueError(
                f"`tensors['{name}']`{kind} holds a local tensor of shape "
                f"{tuple(local.shape)} on rank {rank}, but its share of the global shape "
                f"{shape} split along dimension {dim} over {size} ranks (as torch.chunk "
                f"splits it) is {expected}."
            )
        return cls(local, shape, dim, tuple(spans))

    def share(self, rank: int, rows: tuple[int, int]) -> tuple[int, int, int, int, int] | None:
        """Rank ``rank``'s share of rows ``[r0, r1)`` of the tensor's first dimension
        (rule 3), as ``(dim, start, length)`` of the rows' global view, then ``(start,
        length)`` along the first dimension of the local tensor; None: it holds none."""
        r0, r1 = rows
        if self.dim is None:
            return (0, 0, r1 - r0, r0, r1 - r0)
        offset, held = self.spans[rank]
        if self.dim == 0:
            start, end = max(r0, offset), min(r1, offset + held)
            if end <= start:
                return None
            return (0, start - r0, end - start, start - offset, end - start)
        if held == 0:
            return None
        return (self.dim, offset, held, r0, r1 - r0)

    def rows_of(self, part: torch.Tensor, rows: tuple[int, int]) -> torch.Tensor:
        """The bytes ``part`` (uint8) as rows ``[r0, r1)`` of the global tensor."""
        inner = self.shape[1:] if self.shape else ()
        return part.view(self.local.dtype).view(rows[1] - rows[0], *inner)

    def local_rows(self, start: int, length: int) -> torch.Tensor:
        """Rows ``[start, start + length)`` of the local tensor (a 0-d one as one row)."""
        local = self.local if self.local.dim() else self.local.view(1)
        return local.narrow(0, start, length)

    @property
    def everywhere(self) -> bool:
        """Whether every rank holds the whole tensor (rule 1)."""
        return self.dim is None


def _chunk(length: int, size: int, rank: int) -> tuple[int, int]:
    """``(size, offset)`` of ``rank``'s chunk of ``length`` split over ``size`` ranks as
    ``torch.chunk`` splits it (DTensor's ``Shard``)."""
    step = -(-length // size) if length else 0
    offset = min(length, step * rank)
    return min(step, length - offset), offset


def _dtensor_class() -> type | None:
    """``DTensor``, where its module was loaded (rule 4)."""
    module = sys.modules.get("torch.distributed.tensor")
    found = getattr(module, "DTensor", None)
    return found if isinstance(found, type) else None
