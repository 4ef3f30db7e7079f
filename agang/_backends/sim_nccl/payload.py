"""The bytes a simulated NCCL op's inputs travel as between processes, and back.

An op's inputs and outputs are small trees (a tensor, lists of tensors, a tensor with
its split sizes, None). ``Layout`` records a tree's shape with each tensor's dtype and
shape in place of its data; ``encode`` lays the tensors' bytes end to end in tree order
(contiguous, native byte order: every process of a simulation runs on one kind of
machine), and ``decode`` rebuilds the tree from a layout and those bytes, each tensor
new. Bytes, not values, travel, so every dtype goes as it is (bool, complex's real views,
the float8 kinds), and a peer's inputs decode to exactly what the peer holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


class Layout:
    """A tree's structure and tensor metadata (module docstring); picklable."""

    def __init__(self, skeleton: Any) -> None:
        self.skeleton = skeleton
        self.nbytes = sum(_nbytes(dtype, shape) for dtype, shape in _specs(skeleton))

    @classmethod
    def of(cls, tree: Any) -> Layout:
        return cls(_skeleton(tree))

    def tensors(self, tree: Any) -> list[torch.Tensor]:
        """The tensors of ``tree`` (which has this layout), in tree order."""
        return list(_tensors(tree))


def encode(tree: Any) -> torch.Tensor:
    """The bytes of ``tree``'s tensors, end to end in tree order, as one uint8 tensor."""
    chunks = [_bytes(tensor) for tensor in _tensors(tree)]
    if not chunks:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat(chunks)


def decode(layout: Layout, body: torch.Tensor) -> Any:
    """A tree of ``layout`` whose tensors are new, read from ``body`` (``encode``'s)."""
    if body.numel() != layout.nbytes:
        raise ValueError(f"A payload of {body.numel()} bytes, where {layout.nbytes} are due.")
    offset = 0

    def tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        nonlocal offset
        size = _nbytes(dtype, shape)
        chunk = body[offset : offset + size].clone()  # its own storage, aligned
        offset += size
        return chunk.view(dtype).reshape(shape)

    return _build(layout.skeleton, tensor)


def scratch(layout: Layout) -> Any:
    """A tree of ``layout`` with new, uninitialised tensors."""
    return _build(layout.skeleton, lambda dtype, shape: torch.empty(shape, dtype=dtype))


def _skeleton(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return ("tensor", tree.dtype, tuple(tree.shape))
    if isinstance(tree, list):
        return ("list", [_skeleton(item) for item in tree])
    if isinstance(tree, tuple):
        return ("tuple", [_skeleton(item) for item in tree])
    return ("value", tree)


def _specs(skeleton: Any) -> Iterator[tuple[torch.dtype, tuple[int, ...]]]:
    kind, *rest = skeleton
    if kind == "tensor":
        yield rest[0], rest[1]
    elif kind in ("list", "tuple"):
        for child in rest[0]:
            yield from _specs(child)


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, list | tuple):
        for item in tree:
            yield from _tensors(item)


def _build(skeleton: Any, tensor: Any) -> Any:
    kind, *rest = skeleton
    if kind == "tensor":
        return tensor(rest[0], rest[1])
    if kind == "list":
        return [_build(child, tensor) for child in rest[0]]
    if kind == "tuple":
        return tuple(_build(child, tensor) for child in rest[0])
    return rest[0]


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count * dtype.itemsize


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return flat.view(torch.uint8)
