"""``Sharded``: a plain tensor that is this rank's shard of a larger one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch


@dataclass(frozen=True)
class Sharded:
    """This rank's shard of a tensor of global ``shape``, split along ``dim`` over the
    ranks of a gang as ``torch.chunk`` splits it (what a ``DTensor`` with ``Shard(dim)``
    on the gang's ranks holds): for a weights channel's side that is a gang, where its
    tensors are plain ones (a tensor-parallel server's slices).

    Example:
        ```python
        import torch

        import agang

        # Rank 1 of 2 holds rows 4..6 of a [7, 3] weight (torch.chunk: 4 rows, then 3).
        shard = agang.Sharded(torch.zeros(3, 3), dim=0, shape=(7, 3))
        assert shard.shape == (7, 3)
        ```
    """

    tensor: torch.Tensor
    dim: int
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        tensor, dim, shape = (
            cast(object, self.tensor),
            cast(object, self.dim),
            cast(object, self.shape),
        )
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"`tensor` must be a tensor, but is of type `{type(tensor).__name__}`.")
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"`dim` must be an int, but is {dim!r}.")
        sizes = tuple(shape) if isinstance(shape, tuple | list | torch.Size) else None
        if sizes is None or not all(isinstance(n, int) and n >= 0 for n in sizes):
            raise TypeError(f"`shape` must be a tuple of sizes (ints >= 0), but is {shape!r}.")
        if not 0 <= dim < len(sizes):
            raise ValueError(f"`dim` must be a dimension of `shape` {sizes}, but is {dim}.")
        if tensor.dim() != len(sizes):
            raise ValueError(
                f"`tensor` has {tensor.dim()} dimensions, and `shape` {sizes} has "
                f"{len(sizes)}: a shard has the dimensions of the whole."
            )
        object.__setattr__(self, "shape", sizes)
