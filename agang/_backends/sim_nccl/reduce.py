"""Reducing tensors as a collective does, in plain torch: what FakeWorld computes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agang._reduce_op import ReduceOp


def reduce_tensors(tensors: Sequence[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """The reduction of ``tensors`` by ``op``, in rank order, without type promotion."""
    result = tensors[0].clone()
    for tensor in tensors[1:]:
        if result.dtype == torch.bool:
            if op in (ReduceOp.SUM, ReduceOp.MAX):
                result.logical_or_(tensor)
            else:
                result.logical_and_(tensor)
        elif op in (ReduceOp.SUM, ReduceOp.MEAN):
            result.add_(tensor)
        elif op is ReduceOp.PRODUCT:
            result.mul_(tensor)
        elif op is ReduceOp.MIN:
            torch.minimum(result, tensor, out=result)
        else:
            torch.maximum(result, tensor, out=result)
    if op is ReduceOp.MEAN:
        result.div_(len(tensors))
    return result
