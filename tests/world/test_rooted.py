"""The rooted collectives (reduce, gather, scatter) beyond the conformance program.

``test_conformance.py`` checks their results against c10d on Gloo and against the
reference on the fakes; ``test_validation.py`` their refusals. Here: both layouts of the
root's tensor, what ``await`` returns on and off the root, FakeGang's copies, order
checking of the root, busy tensors, statistics and results into leaves that require grad.
"""

from __future__ import annotations

import math

import pytest
import torch

import agang
from agang import ReduceOp
from agang.testing import FakeWorld

pytestmark = pytest.mark.anyio

SIZE = 3


async def _await_all(handles: list[agang.Handle[object]]) -> list[object]:
    return [await handle for handle in handles]


@pytest.mark.parametrize("layout", ["stacked", "concatenated"])
async def test_gather_fills_the_destination_in_either_layout(layout: str) -> None:
    world = FakeWorld(SIZE)
    inputs = [torch.full((2, 2), float(rank)) for rank in range(SIZE)]
    shape = (SIZE, 2, 2) if layout == "stacked" else (SIZE * 2, 2)
    output = torch.zeros(shape)

    handles = [
        gang.gather(output if gang.rank == 1 else None, inputs[gang.rank], 1) for gang in world
    ]
    results = await _await_all(handles)

    assert results[1] is output
    assert results[0] is None
    assert results[2] is None
    assert torch.equal(output.view(SIZE, 2, 2), torch.stack(inputs))
    assert [h.op for h in handles] == ["gather"] * SIZE
    assert [h.num_bytes for h in handles] == [16, 16 * (SIZE + 1), 16]


@pytest.mark.parametrize("layout", ["stacked", "concatenated"])
async def test_scatter_sends_block_r_to_rank_r_in_either_layout(layout: str) -> None:
    world = FakeWorld(SIZE)
    shape = (SIZE, 2, 2) if layout == "stacked" else (SIZE * 2, 2)
    input = torch.arange(SIZE * 4.0).view(shape)
    original = input.clone()
    outputs = [torch.zeros(2, 2) for _ in range(SIZE)]

    handles = [
        gang.scatter(outputs[gang.rank], input if gang.rank == 2 else None, 2) for gang in world
    ]
    results = await _await_all(handles)

    assert all(result is output for result, output in zip(results, outputs, strict=True))
    for rank, output in enumerate(outputs):
        assert output.view(-1).tolist() == [4.0 * rank + i for i in range(4)]
    assert torch.equal(input, original)


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.MAX])
async def test_reduce_returns_the_tensor_everywhere_and_the_result_on_the_destination(
    op: ReduceOp,
) -> None:
    world = FakeWorld(SIZE)
    tensors = [torch.tensor([1.0, -2.0]) * (rank + 1) for rank in range(SIZE)]
    expected = {
        ReduceOp.SUM: [6.0, -12.0],
        ReduceOp.MEAN: [2.0, -4.0],
        ReduceOp.MAX: [3.0, -2.0],
    }[op]

    handles = [gang.reduce(tensors[gang.rank], 0, op) for gang in world]
    results = await _await_all(handles)

    assert all(result is tensor for result, tensor in zip(results, tensors, strict=True))
    assert tensors[0].tolist() == expected


async def test_fake_gang_roots_are_copies_of_this_rank() -> None:
    gang = agang.FakeGang(rank=1, size=3)

    reduced = await gang.reduce(torch.tensor([1.0, 2.0]), 1)
    untouched = await gang.reduce(torch.tensor([1.0, 2.0]), 0)
    gathered = await gang.gather(torch.empty(6, dtype=torch.int64), torch.tensor([5, 6]), 1)
    not_gathered = await gang.gather(None, torch.tensor([5, 6]), 2)
    scattered = await gang.scatter(torch.zeros(2), torch.arange(6.0).view(3, 2), 1)
    not_scattered = await gang.scatter(torch.zeros(2), None, 0)

    assert reduced.tolist() == [3.0, 6.0]  # three copies, summed
    assert untouched.tolist() == [1.0, 2.0]
    assert gathered is not None
    assert gathered.tolist() == [5, 6] * 3
    assert not_gathered is None
    assert scattered.tolist() == [2.0, 3.0]  # block 1 of the source's input
    assert not_scattered.tolist() == [0.0, 0.0]  # no copy of another source's blocks
    assert gang.statistics().num_issued == 6


async def test_ranks_that_disagree_on_the_root_fail_the_order_check() -> None:
    world = FakeWorld(2, check_order=True)

    handles = [gang.reduce(torch.ones(2), gang.rank) for gang in world]

    for handle in handles:
        with pytest.raises(agang.CollectiveMismatchError) as info:
            await handle
        assert "reduce(SUM, destination_rank=0, float32[2])" in str(info.value)
        assert "reduce(SUM, destination_rank=1, float32[2])" in str(info.value)


async def test_a_busy_output_of_gather_is_refused() -> None:
    world = FakeWorld(2, op_timeout=math.inf)
    output = torch.zeros(2, 2)
    first = world[0].gather(output, torch.ones(2), 0)  # pending: rank 1 has not issued

    with pytest.raises(agang.TensorBusyError, match="`output`"):
        world[0].gather(output, torch.ones(2), 0)

    second = world[1].gather(None, torch.full((2,), 2.0), 0)
    assert await first is output
    assert await second is None
    assert output.tolist() == [[1.0, 1.0], [2.0, 2.0]]


async def test_results_go_into_leaves_that_require_grad() -> None:
    async def program(gang: agang.Gang) -> list[object]:
        leaf = torch.full((2,), float(gang.rank + 1), requires_grad=True)
        await gang.reduce(leaf, 0, ReduceOp.MEAN)
        gathered = torch.zeros(gang.size, 2, requires_grad=True) if gang.rank == 1 else None
        await gang.gather(gathered, torch.ones(2), 1)
        shard = torch.zeros(2, requires_grad=True)
        blocks = torch.arange(2.0 * gang.size) if gang.rank == 0 else None
        await gang.scatter(shard, blocks, 0)
        kept = [t for t in (leaf, gathered, shard) if t is not None]
        return [
            leaf.tolist() if gang.rank == 0 else None,
            None if gathered is None else gathered.tolist(),
            shard.tolist(),
            all(t.is_leaf and t.requires_grad for t in kept),
        ]

    results = await FakeWorld(2).run(program)

    assert results == [
        [[1.5, 1.5], None, [0.0, 1.0], True],
        [None, [[1.0, 1.0], [1.0, 1.0]], [2.0, 3.0], True],
    ]
