"""Reduction operators, and how each maps onto c10d's."""

from __future__ import annotations

import enum

import torch.distributed as dist


class ReduceOp(enum.Enum):
    """How a reducing collective combines the ranks' tensors."""

    SUM = "sum"
    MEAN = "mean"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"


_NATIVE = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
}


def to_c10d(op: ReduceOp, *, backend: str) -> tuple[dist.ReduceOp.RedOpType, bool]:
    """Returns the c10d op to issue, and whether the result must then be divided by size.

    ``AVG`` exists on NCCL only; elsewhere MEAN is a SUM followed by a division.
    """
    if op is ReduceOp.MEAN:
        if backend == "nccl":
            return dist.ReduceOp.AVG, False
        return dist.ReduceOp.SUM, True
    return _NATIVE[op], False
