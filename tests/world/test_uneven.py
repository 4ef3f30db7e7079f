"""Uneven all_to_all and all_gather, and exchange, beyond the conformance program.

``test_conformance.py`` checks their results against c10d on Gloo and against the
reference on the fakes; ``test_validation.py`` their refusals. Here: the patterns they
are for (an MoE token exchange, a pipeline step) with exact rows on FakeWorld, the
simulated NCCL group and real Gloo ranks; what the ranks must agree on (split sizes
between a pair, fingerprints), deadlines, busy tensors and FakeGang's copies.
"""

from __future__ import annotations

import math
import time
from typing import Any

import anyio
import pytest
import torch

import agang
from agang._engine import busy
from agang.testing import FakeWorld, SimulatedNccl, run_world

pytestmark = pytest.mark.anyio

# An MoE step on 3 ranks: rank i routes MOE_SPLITS[i][j] tokens (rows) to rank j's expert.
MOE_SPLITS = [[1, 2, 0], [0, 1, 3], [2, 0, 1]]
GATHER_SIZES = [1, 2, 3]


def moe_tokens(rank: int) -> torch.Tensor:
    """Rank r's tokens, rows of 2 values: token t is [100 r + t, -(100 r + t)]."""
    ids = torch.arange(sum(MOE_SPLITS[rank]), dtype=torch.float32) + 100 * rank
    return torch.stack([ids, -ids], dim=1)


def moe_expected(rank: int) -> list[list[float]]:
    """What rank ``rank``'s expert receives: each sender's block for it, in rank order."""
    rows = []
    for sender, splits in enumerate(MOE_SPLITS):
        first = sum(splits[:rank]) + 100 * sender
        rows += [[first + t, -(first + t)] for t in range(splits[rank])]
    return [[float(v) for v in row] for row in rows]


async def moe_all_to_all(gang: agang.Gang) -> list[list[float]]:
    """The router's counts first (an even all_to_all), then the tokens (uneven)."""
    counts = torch.tensor(MOE_SPLITS[gang.rank])
    received = await gang.all_to_all(torch.empty_like(counts), counts)
    tokens = moe_tokens(gang.rank)
    output = torch.full((int(received.sum()), 2), -1.0)
    result = await gang.all_to_all(
        output,
        tokens,
        output_split_sizes=received.tolist(),
        input_split_sizes=counts.tolist(),
    )
    assert result is output
    return result.tolist()  # type: ignore[no-any-return]


async def uneven_all_gather(gang: agang.Gang) -> list[list[int]]:
    input = torch.full((GATHER_SIZES[gang.rank], 2), gang.rank, dtype=torch.int64)
    output = torch.full((sum(GATHER_SIZES), 2), -1, dtype=torch.int64)
    result = await gang.all_gather(output, input, output_split_sizes=GATHER_SIZES)
    assert result is output
    return result.tolist()  # type: ignore[no-any-return]


GATHERED = [[0, 0], [1, 1], [1, 1], [2, 2], [2, 2], [2, 2]]


async def ring(gang: agang.Gang) -> list[float]:
    """Each rank sends to the next and receives from the previous, in one batch."""
    after, before = (gang.rank + 1) % gang.size, (gang.rank - 1) % gang.size
    mine = torch.full((3,), float(gang.rank))
    [received] = await gang.exchange([(mine, after)], [(torch.zeros(3), before)])
    return received.tolist()  # type: ignore[no-any-return]


async def pipeline_step(gang: agang.Gang) -> dict[str, Any]:
    """A pipeline stage sends activations forward and gradients back, and receives the
    previous stage's activations and the next one's gradients, as one batch; the ends
    of the pipeline have one neighbour only."""
    rank, last = gang.rank, gang.size - 1
    activations = torch.full((2, 2), 10.0 * rank)
    gradients = torch.full((2,), -1.0 * rank, dtype=torch.float64)
    sends, recvs, names = [], [], []
    if rank < last:
        sends.append((activations, rank + 1))
        recvs.append((torch.zeros(2, dtype=torch.float64), rank + 1))
        names.append("gradients")
    if rank > 0:
        sends.append((gradients, rank - 1))
        recvs.append((torch.zeros(2, 2), rank - 1))
        names.append("activations")
    received = await gang.exchange(sends, recvs)
    return {name: t.tolist() for name, t in zip(names, received, strict=True)}


def expected_pipeline(size: int) -> list[dict[str, Any]]:
    expected: list[dict[str, Any]] = []
    for rank in range(size):
        step: dict[str, Any] = {}
        if rank < size - 1:
            step["gradients"] = [-1.0 * (rank + 1)] * 2
        if rank > 0:
            step["activations"] = [[10.0 * (rank - 1)] * 2] * 2
        expected.append(step)
    return expected


async def patterns(gang: agang.Gang) -> dict[str, Any]:
    return {
        "moe": await moe_all_to_all(gang),
        "gathered": await uneven_all_gather(gang),
        "ring": await ring(gang),
        "pipeline": await pipeline_step(gang),
        "ops": gang.statistics().num_completed,
    }


def check_patterns(results: list[dict[str, Any]]) -> None:
    pipeline = expected_pipeline(len(results))
    for rank, result in enumerate(results):
        assert result["moe"] == moe_expected(rank)
        assert result["gathered"] == GATHERED
        assert result["ring"] == [float((rank - 1) % len(results))] * 3
        assert result["pipeline"] == pipeline[rank]
        assert result["ops"] == 5


def test_the_expected_rows_are_the_routed_tokens() -> None:
    # The reference itself, spelled out for rank 1: rank 0's 2 tokens 1 and 2, its own
    # token 100, and nothing from rank 2.
    assert moe_expected(1) == [[1.0, -1.0], [2.0, -2.0], [100.0, -100.0]]


async def test_the_patterns_on_fake_world() -> None:
    check_patterns(await FakeWorld(3).run(patterns))


async def test_the_patterns_on_simulated_nccl() -> None:
    with SimulatedNccl(3) as sim:
        gangs = sim.gangs()
        results: list[Any] = [None] * 3

        async def run(rank: int) -> None:
            results[rank] = await patterns(gangs[rank])

        with anyio.fail_after(30):
            async with anyio.create_task_group() as group:
                for rank in range(3):
                    group.start_soon(run, rank)
        for gang in gangs:
            await gang.close()
    check_patterns(results)


async def _gloo_program(gang: agang.Gang) -> dict[str, Any]:
    """The patterns, then a peer that never calls: rank 0 waits to receive from rank 1,
    which never sends, under a 1 s deadline; rank 1 outlives it before closing."""
    report = await patterns(gang)
    if gang.rank == 0:
        started = time.monotonic()
        try:
            await gang.exchange(recvs=[(torch.zeros(2), 1)], timeout=1.0)
        except agang.GangTimeoutError as error:
            report["timeout"] = (error.context.op, time.monotonic() - started)
    else:
        await anyio.sleep(2.5)  # past rank 0's deadline and blame (at most 0.5 s)
    return report


@pytest.mark.gloo
def test_the_patterns_and_a_missed_deadline_on_gloo() -> None:
    results = run_world(_gloo_program, 3)

    check_patterns(results)
    op, elapsed = results[0]["timeout"]
    assert op == "exchange"
    assert 0.9 < elapsed < 10.0


async def _checked_gloo_program(gang: agang.Gang) -> dict[str, Any]:
    """The patterns on an order-checked gang, then sizes that disagree: rank 1 sends
    rank 0 two rows where rank 0 expects one (unchecked, Gloo kills rank 0: SIGABRT)."""
    report = await patterns(gang)
    sends = [[1, 1, 1], [2, 1, 1], [1, 1, 1]][gang.rank]
    receives = [1, 1, 1]
    output = torch.full((3,), -1.0)
    handle = gang.all_to_all(
        output, torch.ones(sum(sends)), output_split_sizes=receives, input_split_sizes=sends
    )
    # Issued before the mismatch is known: its check is in flight beside the report's.
    later = gang.all_reduce(torch.ones(1))
    try:
        await handle
    except agang.CollectiveMismatchError as error:
        report["mismatch"] = str(error)
        report["fingerprints"] = error.fingerprints
    try:
        await later
    except agang.GangError as error:
        report["later"] = type(error).__name__
    report["output"] = output.tolist()
    return report


@pytest.mark.gloo
def test_an_order_checked_gloo_gang_fails_disagreeing_split_sizes_on_every_rank() -> None:
    results = run_world(_checked_gloo_program, 3, init_options={"check_order": True})

    check_patterns(results)  # sizes that agree pass the check
    for result in results:
        assert "rank 1 sends 2 rows to rank 0, which expects 1" in result["mismatch"]
        assert "Nothing was started" in result["mismatch"]
        assert result["output"] == [-1.0] * 3
        assert result["later"] == "GangBrokenError"
        # The sizes of the ranks in the disagreeing pair, each its own, as rank 0 read them.
        assert result["fingerprints"] == {
            0: "all_to_all(split, float32[*])\nsends 1,1,1 receives 1,1,1",
            1: "all_to_all(split, float32[*])\nsends 2,1,1 receives 1,1,1",
        }


# What the ranks must agree on.


async def test_ranks_whose_split_sizes_disagree_fail_together() -> None:
    world = FakeWorld(2)
    # Rank 0 expects 2 rows from rank 1, which sends it 1.
    handles = [
        world[0].all_to_all(
            torch.zeros(3), torch.ones(3), output_split_sizes=[1, 2], input_split_sizes=[1, 2]
        ),
        world[1].all_to_all(
            torch.zeros(4), torch.ones(3), output_split_sizes=[2, 2], input_split_sizes=[1, 2]
        ),
    ]

    for handle in handles:
        with pytest.raises(agang.GangError, match="rank 1 sends 1 rows to rank 0, which expects 2"):
            await handle


async def test_the_fingerprint_names_the_rows_but_not_the_split_sizes() -> None:
    world = FakeWorld(2, check_order=True)

    agreeing = await world.run(moe_pair)
    disagreeing = [
        gang.all_to_all(
            torch.zeros(2, gang.rank + 1), torch.zeros(2, gang.rank + 1), input_split_sizes=[1, 1]
        )
        for gang in world
    ]

    assert agreeing == [[[0.0], [0.0], [1.0]], [[0.0], [1.0]]]
    for handle in disagreeing:
        with pytest.raises(agang.CollectiveMismatchError) as info:
            await handle
        assert "all_to_all(split, float32[*, 1])" in str(info.value)
        assert "all_to_all(split, float32[*, 2])" in str(info.value)


async def test_an_order_checked_gang_fails_disagreeing_split_sizes_before_any_row_moves() -> None:
    world = FakeWorld(2, check_order="call_site")
    outputs = [torch.zeros(3), torch.zeros(4)]
    # Rank 0 expects 2 rows from rank 1, which sends it 1.
    handles = [
        world[rank].all_to_all(
            outputs[rank],
            torch.ones(3),
            output_split_sizes=[[1, 2], [2, 2]][rank],
            input_split_sizes=[1, 2],
        )
        for rank in range(2)
    ]

    for rank, handle in enumerate(handles):
        with pytest.raises(agang.CollectiveMismatchError) as info:
            await handle
        message = str(info.value)
        assert "split sizes disagree at collective #0" in message
        assert "rank 1 sends 1 rows to rank 0, which expects 2" in message
        assert "Nothing was started" in message
        assert "test_uneven.py" in message  # the call site, on the op's line
        assert info.value.fingerprints[rank].endswith(
            ["sends 1,2 receives 1,2", "sends 1,2 receives 2,2"][rank]
        )
        assert outputs[rank].eq(0).all()  # no row arrived
        with pytest.raises(agang.GangBrokenError):
            world[rank].all_reduce(torch.ones(1))


PAIR_SPLITS = [[2, 1], [1, 1]]  # rank 0 sends 2 rows to itself and 1 to rank 1


async def moe_pair(gang: agang.Gang) -> list[list[float]]:
    sends = PAIR_SPLITS[gang.rank]
    receives = [PAIR_SPLITS[sender][gang.rank] for sender in range(gang.size)]
    input = torch.full((sum(sends), 1), float(gang.rank))
    output = torch.full((sum(receives), 1), -1.0)
    await gang.all_to_all(output, input, output_split_sizes=receives, input_split_sizes=sends)
    return output.tolist()  # type: ignore[no-any-return]


async def test_an_uneven_all_gather_is_order_checked_with_its_sizes() -> None:
    world = FakeWorld(2, check_order=True)
    sizes = [[1, 2], [1, 3]]  # rank 1 thinks it has 3 rows, rank 0 that it has 2

    handles = [
        gang.all_gather(
            torch.zeros(sum(sizes[gang.rank])),
            torch.ones(sizes[gang.rank][gang.rank]),
            output_split_sizes=sizes[gang.rank],
        )
        for gang in world
    ]

    for handle in handles:
        with pytest.raises(agang.CollectiveMismatchError) as info:
            await handle
        assert "all_gather(output_split_sizes=[1, 2], float32[*])" in str(info.value)
        assert "all_gather(output_split_sizes=[1, 3], float32[*])" in str(info.value)


# Deadlines, busy tensors, statistics.


async def test_a_peer_that_never_calls_is_the_deadline_error() -> None:
    world = FakeWorld(2)

    with pytest.raises(agang.GangTimeoutError) as info:
        await world[0].all_to_all(
            torch.zeros(2),
            torch.ones(3),
            output_split_sizes=[1, 1],
            input_split_sizes=[1, 2],
            timeout=0.2,
        )

    assert (info.value.context.op, info.value.context.timeout) == ("all_to_all", 0.2)


async def test_an_exchange_holds_its_tensors_until_it_ends() -> None:
    world = FakeWorld(2, op_timeout=math.inf)
    sent, received = torch.ones(4), torch.zeros(4)
    first = world[0].exchange([(sent, 1)], [(received, 1)])

    with pytest.raises(agang.TensorBusyError, match=r"`recvs\[0\]\[0\]`"):
        world[0].exchange(recvs=[(received, 1)])
    with pytest.raises(agang.TensorBusyError, match="`tensor`"):
        world[0].send(sent[:2], 1)

    second = world[1].exchange([(torch.full((4,), 2.0), 0)], [(torch.zeros(4), 0)])
    assert (await first)[0] is received
    assert (await second)[0].tolist() == [1.0] * 4
    assert received.tolist() == [2.0] * 4
    statistics = world[0].statistics()
    assert (statistics.num_issued, statistics.num_completed) == (1, 1)
    assert (first.op, first.num_bytes) == ("exchange", 32)


async def test_sends_that_overlap_hold_all_their_memory() -> None:
    # Two sends that share part of one buffer: the whole span is busy, not only the
    # first send's part (a claim once kept the first and dropped the overlapping one).
    world = FakeWorld(3, op_timeout=math.inf)
    buffer = torch.arange(8.0)
    sent = world[0].exchange([(buffer[:4], 1), (buffer[2:], 2)])

    for part in (buffer[:2], buffer[3:5], buffer[6:]):
        with pytest.raises(agang.TensorBusyError):
            world[0].broadcast(part)

    got = [world[1].exchange(recvs=[(torch.zeros(4), 0)]), world[2].exchange(
        recvs=[(torch.zeros(6), 0)])]  # fmt: skip
    await sent
    assert [(await h)[0].tolist() for h in got] == [[0.0, 1, 2, 3], [2.0, 3, 4, 5, 6, 7]]
    assert busy.num_busy() == 0


async def test_exchange_matches_plain_sends_and_receives_in_order() -> None:
    world = FakeWorld(2)
    a, b = torch.zeros(2), torch.zeros(3)

    send = world[0].send(torch.ones(2), 1)
    batch = world[0].exchange([(torch.full((3,), 2.0), 1)])
    received = world[1].exchange(recvs=[(a, 0), (b, 0)])

    await send
    await batch
    assert await received == [a, b]
    assert (a.tolist(), b.tolist()) == ([1.0, 1.0], [2.0, 2.0, 2.0])


async def test_one_tensor_may_be_sent_to_several_peers_in_one_exchange() -> None:
    # Sends are only read: a halo or a weight block goes out to each neighbour as it is.
    world = FakeWorld(3)
    block = torch.arange(4.0)
    left, right = torch.zeros(4), torch.zeros(4)

    sent = world[0].exchange([(block, 1), (block, 2)])
    got = [world[1].exchange(recvs=[(left, 0)]), world[2].exchange(recvs=[(right, 0)])]

    assert await sent == []
    assert [await handle for handle in got] == [[left], [right]]
    assert left.tolist() == right.tolist() == block.tolist()


async def test_fake_gang_copies_equal_blocks_and_has_no_peers_to_exchange_with() -> None:
    gang = agang.FakeGang(rank=1, size=3)

    moved = await gang.all_to_all(
        torch.zeros(6), torch.arange(6.0), output_split_sizes=[2, 2, 2], input_split_sizes=[1, 2, 3]
    )
    gathered = await gang.all_gather(
        torch.zeros(3, 2), torch.ones(1, 2), output_split_sizes=[1] * 3
    )

    assert moved.tolist() == [1.0, 2.0] * 3  # block 1 of every copy
    assert gathered.tolist() == [[1.0, 1.0]] * 3
    with pytest.raises(agang.GangError, match="copies of this one"):
        await gang.all_gather(torch.zeros(4), torch.ones(1), output_split_sizes=[2, 1, 1])
    with pytest.raises(agang.GangError, match="cannot send or receive"):
        gang.exchange([(torch.ones(2), 0)])
