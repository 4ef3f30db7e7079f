"""Layouts of a gang's tensors and each rank's share of a bucket
(``agang._weights.sharding``): the shares of every rank cover each part of a bucket
once, on uneven splits, and what cannot be moved is refused, naming the tensor."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor import Shard

from agang import Sharded
from agang._weights.buckets import as_bytes
from agang._weights.plan import Plan
from agang._weights.sharding import Layout


def _layouts(full: torch.Tensor, dim: int | None, size: int) -> list[Layout]:
    """Each rank's layout of ``full`` split along ``dim`` (None: whole everywhere)."""
    if dim is None:
        return [Layout.of("w", full.clone(), rank, size) for rank in range(size)]
    chunks = list(torch.chunk(full, size, dim))
    # torch.chunk gives fewer chunks where the rows run out: the last ranks hold none.
    shape = list(full.shape)
    shape[dim] = 0
    chunks += [torch.zeros(shape, dtype=full.dtype)] * (size - len(chunks))
    return [
        Layout.of("w", Sharded(c.contiguous(), dim, tuple(full.shape)), rank, size)
        for rank, c in enumerate(chunks)
    ]


CASES = [
    ((7, 3), 0, 2),
    ((1, 5), 0, 2),  # one row over two ranks: rank 1 holds none
    ((5, 2), 0, 4),  # 2, 2, 1, 0
    ((3, 4), 1, 4),  # 1, 1, 1, 0 columns
    ((4, 6, 5), 1, 2),
    ((2, 3, 9), 2, 3),
    ((9, 4), None, 3),
    ((), None, 2),
]


@pytest.mark.parametrize(("shape", "dim", "size"), CASES)
def test_the_shares_of_every_part_of_every_bucket_rebuild_it_exactly(
    shape: tuple[int, ...], dim: int | None, size: int
) -> None:
    full = torch.randn(shape, dtype=torch.float64)
    layouts = _layouts(full, dim, size)
    plan = Plan.of({"w": full}, bucket_bytes=1024, split=True)
    # Every row range (what a split plan's parts are).
    rows = full.shape[0] if full.dim() else 1
    ranges = [(a, b) for a, b in itertools.combinations(range(rows + 1), 2)]
    whole = as_bytes(full)
    row = plan.row_bytes(0)
    for r0, r1 in ranges:
        bucket = torch.full(((r1 - r0) * row,), 0xEE, dtype=torch.uint8)
        covered = torch.zeros(bucket.numel() // 8, dtype=torch.float64)
        holders = range(1) if dim is None else range(size)  # held whole: rank 0's
        for rank in holders:
            layout = layouts[rank]
            share = layout.share(rank, (r0, r1))
            if share is None:
                continue
            g_dim, g_start, g_len, l_start, l_len = share
            into = layout.rows_of(bucket, (r0, r1)).narrow(g_dim, g_start, g_len)
            into.copy_(layout.local_rows(l_start, l_len))
            marks = layout.rows_of(as_bytes(covered), (r0, r1))
            marks.narrow(g_dim, g_start, g_len).add_(1)
        assert torch.equal(bucket, whole[r0 * row : r1 * row]), (r0, r1)
        assert covered.eq(1).all(), (r0, r1)  # every element once, by one rank


@pytest.mark.parametrize(("length", "size"), [(7, 2), (1, 2), (3, 4), (5, 4), (1025, 2), (0, 3)])
def test_the_split_is_dtensor_shard_s(length: int, size: int) -> None:
    """Rule 1: each rank's (size, offset) is what torch's public
    ``Shard.local_shard_size_and_offset`` gives."""
    layout = _layouts(torch.zeros(length, 2), 0, size)[0]
    for rank in range(size):
        size_at, offset = Shard.local_shard_size_and_offset(length, size, rank)
        if size_at == 0:
            continue  # torch puts an empty share at the end; no bytes either way
        assert layout.spans[rank] == (offset, size_at), rank


def test_a_local_tensor_that_is_not_its_share_is_refused_naming_it() -> None:
    with pytest.raises(
        ValueError, match=r"`tensors\['enc.w'\]` .*shape \(3, 3\) on rank 1.*is \(4, 3\)"
    ):
        Layout.of("enc.w", Sharded(torch.zeros(3, 3), 0, (8, 3)), 1, 2)  # rank 1 holds 4
    with pytest.raises(ValueError, match="`dim` must be a dimension"):
        Sharded(torch.zeros(3), 1, (3,))
    with pytest.raises(TypeError, match="`tensors\\['x'\\]` must be a tensor"):
        Layout.of("x", [1, 2], 0, 2)
