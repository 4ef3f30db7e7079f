"""Reduction operators: how a reducing collective combines the ranks' tensors.

The enum alone; how each maps onto a transport's own operators is that backend's
knowledge (c10d's in ``agang._backends.c10d.calls``).
"""

from __future__ import annotations

import enum


class ReduceOp(enum.Enum):
    """How a reducing collective combines the ranks' tensors."""

    SUM = "sum"
    MEAN = "mean"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
