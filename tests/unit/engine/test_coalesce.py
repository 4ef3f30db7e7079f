"""Deterministic coalescing: the pure planner, ``coalesce()`` scopes and bucketed all-reduce.

The planner is driven with plain data; the scopes and buckets run on FakeWorld, whose
ranks hold different data, so every result is checked against a reduction in plain torch.
"""

from __future__ import annotations

import anyio
import pytest
import torch

import agang
from agang import ReduceOp
from agang._engine import busy
from agang._engine.grouping import FlatBuffers, plan_buckets
from agang.testing import FakeWorld, reduce_tensors

# The planner (the grouping rules "Groups" and "Buckets" of ``agang._engine.grouping``).


def test_without_a_cap_each_key_is_one_group_in_order_of_first_member() -> None:
    items = [("f32", 4), ("f16", 2), ("f32", 4), ("i64", 8), ("f16", 2)]
    assert plan_buckets(items, None) == [[0, 2], [1, 4], [3]]


def test_buckets_fill_in_list_order_up_to_the_cap() -> None:
    items = [("f32", 40)] * 5
    assert plan_buckets(items, 100) == [[0, 1], [2, 3], [4]]


def test_a_tensor_above_the_cap_is_a_bucket_of_its_own() -> None:
    items = [("f32", 10), ("f32", 500), ("f32", 10)]
    assert plan_buckets(items, 100) == [[0], [1], [2]]


def test_full_buckets_are_issued_before_open_ones() -> None:
    items = [("f16", 10), ("f32", 60), ("f32", 60), ("f32", 10)]
    # The first f32 bucket fills (60 + 60 > 100) and goes first; then the open ones.
    assert plan_buckets(items, 100) == [[1], [0], [2, 3]]


def test_planning_depends_only_on_the_calls() -> None:
    items = [(f"k{i % 3}", (i * 37) % 50 + 1) for i in range(200)]
    assert plan_buckets(items, 64) == plan_buckets(list(items), 64)
    planned = sorted(i for bucket in plan_buckets(items, 64) for i in bucket)
    assert planned == list(range(200))  # every tensor exactly once


# Flat buffers (the rule "Flat ops") and the busy registry's batch release.


def test_a_flat_buffer_is_reused_for_the_same_layout_and_copies_back_exactly() -> None:
    buffers = FlatBuffers()
    shapes = [(3,), (2, 2), (), (1, 5)]  # 1-D, 2-D, 0-dim and a size-1 dimension
    for step in range(3):
        tensors = [torch.full(shape, float(step * 10 + i)) for i, shape in enumerate(shapes)]
        packed = buffers.pack(tensors)
        if step == 0:
            first = packed.flat
        else:
            assert packed.flat is first  # the finished op's buffer, not a new one
        expected = torch.cat([t.reshape(-1) for t in tensors])
        assert torch.equal(packed.flat, expected)
        packed.flat.mul_(2)  # the "reduction"
        buffers.unpack(packed, tensors)
        for tensor, part in zip(tensors, expected.split([t.numel() for t in tensors]), strict=True):
            assert torch.equal(tensor.reshape(-1), part * 2)


def test_flat_buffers_keep_one_per_layout_within_their_byte_cap() -> None:
    buffers = FlatBuffers(max_bytes=64)
    small = [torch.ones(4), torch.ones(4)]  # 32 bytes
    first, second = buffers.pack(small), buffers.pack(small)  # two in flight at once
    assert first.flat is not second.flat
    buffers.unpack(first, small)
    buffers.unpack(second, small)  # the layout already has a kept buffer
    assert buffers.pack(small).flat is first.flat
    assert buffers.pack(small).flat is not first.flat  # it was taken: one per layout

    large = [torch.ones(10), torch.ones(10)]  # 80 bytes: over the cap
    packed = buffers.pack(large)
    buffers.unpack(packed, large)
    assert buffers.pack(large).flat is not packed.flat


def test_releasing_many_claims_at_once_frees_exactly_those() -> None:
    keep = [torch.zeros(8) for _ in range(5)]
    free = [torch.zeros(8) for _ in range(40)]
    kept_claims = [busy.acquire_one("t", t, "kept") for t in keep]
    before = busy.num_busy()
    claims = [busy.acquire_one("t", t, "freed") for t in free]
    busy.release_all(claims[:3])  # few: one by one
    busy.release_all(claims[3:])  # many: one pass
    assert busy.num_busy() == before
    for tensor in keep:
        with pytest.raises(agang.TensorBusyError, match="kept"):
            busy.acquire_one("t", tensor, "again")
    busy.release_all(kept_claims)
    assert busy.num_busy() == before - len(keep)


# Scopes on FakeWorld.


def rank_tensor(rank: int, index: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.arange(3, dtype=dtype) + 10 * rank + index


@pytest.mark.anyio
async def test_a_scope_gives_every_handle_its_own_result() -> None:
    world = FakeWorld(3)
    ops = [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MEAN]
    dtypes = [torch.float32, torch.float32, torch.float64, torch.float32, torch.float32]

    async def program(gang: agang.Gang) -> list[torch.Tensor]:
        tensors = [rank_tensor(gang.rank, i, dtypes[i]) for i in range(len(ops))]
        with gang.coalesce():
            handles = [gang.all_reduce(t, op) for t, op in zip(tensors, ops, strict=True)]
        results = [await handle for handle in handles]
        assert all(r is t for r, t in zip(results, tensors, strict=True))  # in place
        return results

    results = await world.run(program)
    for i, op in enumerate(ops):
        expected = reduce_tensors([rank_tensor(r, i, dtypes[i]) for r in range(3)], op)
        for rank in range(3):
            torch.testing.assert_close(results[rank][i], expected)


@pytest.mark.anyio
async def test_a_scope_issues_one_op_per_group_and_counts_the_coalesced() -> None:
    world = FakeWorld(2)

    async def program(gang: agang.Gang) -> tuple[list[int], int, int]:
        with gang.coalesce():
            handles = [gang.all_reduce(torch.ones(4)) for _ in range(10)]
            handles.append(gang.all_reduce(torch.ones(4, dtype=torch.float64)))
        for handle in handles:
            await handle
        stats = gang.statistics()
        return [h.seq for h in handles], stats.num_issued, stats.num_coalesced

    for seqs, num_issued, num_coalesced in await world.run(program):
        assert seqs == [0] * 10 + [1]  # members share their flat op's number
        assert num_issued == 2
        assert num_coalesced == 10


@pytest.mark.anyio
async def test_awaiting_a_held_op_inside_its_scope_raises() -> None:
    world = FakeWorld(2)

    async def program(gang: agang.Gang) -> str:
        with gang.coalesce():
            handle = gang.all_reduce(torch.ones(1))
            with pytest.raises(RuntimeError, match="held by the open `coalesce"):
                await handle
            with pytest.raises(RuntimeError, match="after the `with` block"):
                handle.wait(timeout=1)
        return str((await handle).item())

    assert await world.run(program) == ["2.0", "2.0"]


@pytest.mark.anyio
async def test_another_kind_of_op_in_a_scope_keeps_program_order() -> None:
    world = FakeWorld(2)

    async def program(gang: agang.Gang) -> list[int]:
        first = torch.ones(2)
        root = torch.full((1,), float(gang.rank + 5))
        with gang.coalesce():
            before = gang.all_reduce(first)
            cast = gang.broadcast(root, source_rank=1)  # issues `before` first
            after = gang.all_reduce(torch.ones(2))
        assert (await before).tolist() == [2.0, 2.0]
        assert (await cast).tolist() == [6.0]
        await after
        return [before.seq, cast.seq, after.seq]

    assert await world.run(program) == [[0, 1, 2], [0, 1, 2]]


@pytest.mark.anyio
async def test_nested_scopes_join_the_outermost() -> None:
    world = FakeWorld(2)

    async def program(gang: agang.Gang) -> list[int]:
        with gang.coalesce():
            a = gang.all_reduce(torch.ones(1))
            with gang.coalesce():
                b = gang.all_reduce(torch.ones(1))
            assert not b.done()  # still held: the outer scope is open
            c = gang.all_reduce(torch.ones(1))
        await a
        await b
        await c
        return [a.seq, b.seq, c.seq]

    assert await world.run(program) == [[0, 0, 0], [0, 0, 0]]


@pytest.mark.anyio
async def test_other_tasks_pass_through_a_scope() -> None:
    world = FakeWorld(2)

    async def program(gang: agang.Gang) -> tuple[bool, float]:
        other: list[agang.Handle[torch.Tensor]] = []
        lane = await gang.lane("side")

        async def elsewhere() -> None:
            other.append(lane.all_reduce(torch.ones(1)))

        with gang.coalesce():
            held = gang.all_reduce(torch.ones(1))
            async with anyio.create_task_group() as group:
                group.start_soon(elsewhere)
            passed = await other[0]  # issued at once, not held by this task's scope
        return passed.item() == 2.0, (await held).item()

    assert await world.run(program) == [(True, 2.0), (True, 2.0)]


@pytest.mark.anyio
async def test_a_scope_left_by_an_exception_still_issues_its_ops() -> None:
    world = FakeWorld(2)

    async def program(gang: agang.Gang) -> float:
        held: list[agang.Handle[torch.Tensor]] = []

        def fail_inside_a_scope() -> None:
            with gang.coalesce():
                held.append(gang.all_reduce(torch.ones(1)))
                raise KeyError("user code failed")

        with pytest.raises(KeyError):
            fail_inside_a_scope()
        return (await held[0]).item()

    assert await world.run(program) == [2.0, 2.0]


@pytest.mark.anyio
async def test_a_held_tensor_is_busy() -> None:
    world = FakeWorld(2)

    async def program(gang: agang.Gang) -> float:
        tensor = torch.ones(4)
        with gang.coalesce():
            handle = gang.all_reduce(tensor)
            with pytest.raises(agang.TensorBusyError, match="`tensor`"):
                gang.all_reduce(tensor[1:])
        return (await handle).sum().item()

    assert await world.run(program) == [8.0, 8.0]


@pytest.mark.anyio
async def test_a_scope_on_a_closed_gang_fails_its_handles_and_frees_tensors() -> None:
    world = FakeWorld(1)
    gang = world[0]
    tensor = torch.ones(2)
    with gang.coalesce():
        handle = gang.all_reduce(tensor)
        await gang.close()
    with pytest.raises(agang.GangClosedError):
        await handle
    assert busy.num_busy() == 0  # type: ignore[attr-defined]


# Bucketed all-reduce.


@pytest.mark.anyio
async def test_bucketed_results_match_a_plain_reduction() -> None:
    world = FakeWorld(3)
    shapes = [(5,), (2, 3), (), (0,), (7,), (1, 1)]

    def inputs(rank: int) -> list[torch.Tensor]:
        return [
            torch.arange(torch.Size(s).numel(), dtype=torch.float64).reshape(s) + rank + i
            for i, s in enumerate(shapes)
        ]

    async def program(gang: agang.Gang) -> list[torch.Tensor]:
        tensors = inputs(gang.rank)
        out = await gang.all_reduce_bucketed(tensors, ReduceOp.MEAN, bucket_bytes=48)
        assert all(o is t for o, t in zip(out, tensors, strict=True))
        return out

    results = await world.run(program)
    for i in range(len(shapes)):
        expected = reduce_tensors([inputs(r)[i] for r in range(3)], ReduceOp.MEAN)
        for rank in range(3):
            torch.testing.assert_close(results[rank][i], expected)


@pytest.mark.anyio
async def test_per_bucket_handles_follow_the_plan() -> None:
    world = FakeWorld(2)

    async def program(gang: agang.Gang) -> list[list[int]]:
        tensors = [torch.ones(10) for _ in range(5)]  # 40 B each
        handles = gang.all_reduce_bucketed(tensors, bucket_bytes=100, per_bucket=True)
        buckets = [await h for h in handles]
        return [[len(b), int(b[0][0].item())] for b in buckets]

    assert await world.run(program) == [[[2, 2], [2, 2], [1, 2]]] * 2


@pytest.mark.anyio
async def test_a_busy_tensor_refuses_the_whole_bucketed_call() -> None:
    world = FakeWorld(2)

    async def program(gang: agang.Gang) -> tuple[int, float]:
        busy = torch.ones(4)
        first = gang.all_reduce(busy)
        tensors = [torch.ones(4), torch.ones(4), busy]
        with pytest.raises(agang.TensorBusyError, match=r"`tensors\[2\]`"):
            gang.all_reduce_bucketed(tensors, bucket_bytes=16)
        issued = gang.statistics().num_issued  # the refused call issued nothing
        await first
        out = await gang.all_reduce_bucketed(tensors[:2], bucket_bytes=16)
        return issued, out[1][0].item()

    assert await world.run(program) == [(1, 2.0), (1, 2.0)]


def test_bucketed_input_is_checked_before_anything_is_issued() -> None:
    gang = agang.FakeGang(size=2)
    with pytest.raises(TypeError, match="`tensors` must be a list"):
        gang.all_reduce_bucketed(torch.ones(2))  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="`bucket_bytes`"):
        gang.all_reduce_bucketed([torch.ones(2)], bucket_bytes=0)
    with pytest.raises(TypeError, match=r"`tensors\[1\]`"):
        gang.all_reduce_bucketed([torch.ones(2), "x"])  # type: ignore[list-item]
    shared = torch.ones(8)
    with pytest.raises(ValueError, match="`tensors` must not overlap"):
        gang.all_reduce_bucketed([shared[:5], shared[4:]])
    with pytest.raises(TypeError, match="`per_bucket`"):
        gang.all_reduce_bucketed([torch.ones(1)], per_bucket=1)  # type: ignore[call-overload]
    assert gang.statistics().num_issued == 0


def test_an_empty_bucketed_call_finishes_at_once() -> None:
    gang = agang.FakeGang(size=2)
    assert gang.all_reduce_bucketed([]).wait(timeout=1) == []
    assert gang.all_reduce_bucketed([], per_bucket=True) == []


def test_fake_gang_scopes_and_buckets_work_synchronously() -> None:
    gang = agang.FakeGang(size=4)
    tensors = [torch.ones(3), torch.ones(2, dtype=torch.float64)]
    with gang.coalesce():
        handles = [gang.all_reduce(t) for t in tensors]
    assert [h.wait(timeout=1).sum().item() for h in handles] == [12.0, 8.0]
    out = gang.all_reduce_bucketed([torch.ones(2)] * 1 + [torch.ones(3)], bucket_bytes=8).wait(1)
    assert [o.sum().item() for o in out] == [8.0, 12.0]


@pytest.mark.anyio
async def test_awaiting_the_scope_waits_for_all_of_it() -> None:
    world = FakeWorld(2)

    async def program(gang: agang.Gang) -> list[list[float]]:
        tensors = [torch.ones(2), torch.ones(3, dtype=torch.float64), torch.ones(1)]
        with gang.coalesce() as batch:
            for tensor in tensors:
                gang.all_reduce(tensor)
            with pytest.raises(RuntimeError, match="held by the open"):
                await batch
            gang.barrier()  # flushes the first three: two flat ops
            gang.all_reduce(torch.ones(1))
        out = await batch
        assert all(o is t for o, t in zip(out, tensors, strict=False))
        assert len(batch.handles) == 4
        return [o.tolist() for o in out]

    expected = [[2.0, 2.0], [2.0, 2.0, 2.0], [2.0], [2.0]]
    assert await world.run(program) == [expected, expected]


@pytest.mark.anyio
async def test_an_empty_scope_and_one_emptied_by_another_op_finish_at_once() -> None:
    world = FakeWorld(2)

    async def program(gang: agang.Gang) -> tuple[list[torch.Tensor], list[float]]:
        with gang.coalesce() as empty:
            pass
        tensor = torch.ones(2)
        with gang.coalesce() as flushed:
            gang.all_reduce(tensor)
            gang.barrier()  # issues the held all_reduce: nothing is left at the end
        await flushed
        return await empty, tensor.tolist()

    assert await world.run(program) == [([], [2.0, 2.0])] * 2
