"""A sharded trainer's pushes in one process (``agang._weights.gathering``,
``following``): a trainer gang of FakeWorld ranks, each holding shards of the weights
(``agang.Sharded``), pushing to whole subscribers through the production publisher, on
the in-process channel of ``tests/support/weightsworld.py``. The same over DTensors and
real processes: ``tests/gloo/test_weights_fsdp.py``."""

from __future__ import annotations

import math
from typing import Any

import anyio
import pytest
import torch
from weightsworld import Channel

from agang import GangClosedError, GangError, PushReport, Sharded
from agang._gang import Gang
from agang._weights.gathering import INLINE_BYTES
from agang._weights.plan import FIRST_BUCKET_BYTES
from agang._weights.publisher import WeightPublisher
from agang.testing import FakeWorld

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60), pytest.mark.usefixtures("short_beats")]

PATIENCE = 10.0
#: (global shape, the dimension it is split along over the trainer gang; None: whole)
SHAPES: dict[str, tuple[tuple[int, ...], int | None]] = {
    "embed": ((300, 4), 0),  # 4800 bytes: direct buckets, cut between rows
    "odd": ((7, 3), 0),  # 4 rows and 3
    "one_row": ((1, 5), 0),  # rank 1 holds none
    "cols": ((6, 5), 1),  # tensor parallel's Shard(1): 3 columns and 2
    "bias": ((3,), None),  # plain: rank 0's
    "step": ((), None),
}


def full(version: float) -> dict[str, torch.Tensor]:
    """The whole model at ``version``: distinct values per element, so a byte out of
    place shows."""
    out = {}
    for index, (name, (shape, _)) in enumerate(SHAPES.items()):
        count = math.prod(shape)
        values = torch.arange(count, dtype=torch.float32) + 1000 * index + version * 1e5
        out[name] = values.reshape(shape)
    return out


def shards(rank: int, size: int, version: float) -> dict[str, Any]:
    """Rank ``rank``'s tensors: each its shard (torch.chunk's) or the whole."""
    out: dict[str, Any] = {}
    for name, value in full(version).items():
        dim = SHAPES[name][1]
        if dim is None:
            out[name] = value.clone()
            continue
        chunks = list(torch.chunk(value, size, dim))
        empty = list(value.shape)
        empty[dim] = 0
        mine = chunks[rank] if rank < len(chunks) else torch.zeros(empty)
        out[name] = Sharded(mine.contiguous(), dim, tuple(value.shape))
    return out


def write(tensors: dict[str, Any], rank: int, size: int, version: float) -> None:
    """The trainer's step: the shards take ``version``'s values, in place."""
    for name, value in shards(rank, size, version).items():
        into = tensors[name].tensor if isinstance(tensors[name], Sharded) else tensors[name]
        came = value.tensor if isinstance(value, Sharded) else value
        into.copy_(came)


async def open_trainer(
    channel: Channel, gang: Gang, tensors: dict[str, Any], bucket_bytes: int = 1024
) -> WeightPublisher:
    opened = await WeightPublisher._open_over(
        gang, tensors, "127.0.0.1:1", "c", 5.0, bucket_bytes, None, lambda _: channel.site
    )
    channel.together.append(opened)
    return opened


async def pushed_once(
    channel: Channel, gang: Gang, ready: anyio.Event
) -> tuple[dict[str, Any], WeightPublisher]:
    """A rank's shards and publisher, once the server opened and version 1 was pushed."""
    tensors = shards(gang.rank, gang.size, 0)
    publisher = await open_trainer(channel, gang, tensors)
    await ready.wait()
    write(tensors, gang.rank, gang.size, 1)
    await publisher.push(1)
    return tensors, publisher


async def whole_server(channel: Channel, name: str = "whole") -> Any:
    """A whole-tensor subscriber, opened once a publisher is (a subscriber waits for the
    plan): it opens beside the trainer's ranks, which wait for it before pushing."""
    tensors = {k: torch.zeros_like(v) for k, v in full(0).items()}
    return await channel.subscriber(tensors, name)


async def run_with_server(
    channel: Channel, world: FakeWorld, trainer: Any
) -> tuple[list[Any], Any]:
    """``trainer(gang, ready)`` on every rank of ``world``, with a whole server opened
    beside them; ``ready`` is set once it opened."""
    ready = anyio.Event()
    opened: list[Any] = []

    async def server() -> None:
        opened.append(await whole_server(channel))
        ready.set()

    async with anyio.create_task_group() as group:
        group.start_soon(server)
        results = await world.run(lambda gang: trainer(gang, ready))
    return results, opened[0]


async def test_a_two_rank_trainer_pushes_exact_bytes_to_a_whole_subscriber(
    channel: Channel,
) -> None:
    async def trainer(gang: Gang, ready: anyio.Event) -> list[PushReport]:
        tensors = shards(gang.rank, gang.size, 0)
        publisher = await open_trainer(channel, gang, tensors)
        await ready.wait()
        reports = []
        for version in (1, 2):
            write(tensors, gang.rank, gang.size, version)
            reports.append(await publisher.push(version))
        await publisher.close()  # on every rank, together
        return reports

    by_rank, server = await run_with_server(channel, FakeWorld(2), trainer)
    server_tensors = server._tensors
    assert by_rank[0] == by_rank[1]  # the same report on every rank
    assert [r.delivered for r in by_rank[0]] == [("whole",), ("whole",)]
    assert await server.receive(timeout=PATIENCE) == 2
    for name, value in full(2).items():
        assert torch.equal(server_tensors[name], value), name


async def test_the_sender_holds_three_buckets_at_most_whatever_the_model(channel: Channel) -> None:
    """Bucket 0 (at most ``FIRST_BUCKET_BYTES`` past one bucket) and a ring of two."""
    bucket = 64 * 1024
    world = FakeWorld(2)
    whole = torch.arange(2 * 1024 * 1024 // 4, dtype=torch.float32).reshape(-1, 64)  # 2 MiB

    async def trainer(gang: Gang) -> int:
        mine = torch.chunk(whole, 2)[gang.rank].contiguous()
        tensors = {"w": Sharded(mine, 0, tuple(whole.shape))}
        publisher = await open_trainer(channel, gang, tensors, bucket)
        await publisher.push(1)
        gathering = getattr(publisher, "_gathering", None)
        await publisher.close()
        return 0 if gathering is None else gathering.allocated_bytes

    allocated = (await world.run(trainer))[0]
    assert 0 < allocated <= min(bucket, FIRST_BUCKET_BYTES) + 2 * bucket, allocated


async def test_a_trainer_rank_whose_shares_do_not_come_fails_the_push_and_no_server_takes_it(
    channel: Channel,
) -> None:
    async def trainer(gang: Gang, ready: anyio.Event) -> str:
        tensors, publisher = await pushed_once(channel, gang, ready)
        write(tensors, gang.rank, gang.size, 2)
        if gang.rank == 1:
            await gang.close()  # lost: its shares of version 2 never come
            return "closed"
        with pytest.raises(GangError) as raised:
            await publisher.push(2, timeout=2.0)
        with pytest.raises(GangError, match="can push no more"):
            await publisher.push(3)
        return str(raised.value)

    results, server = await run_with_server(channel, FakeWorld(2), trainer)
    said, server_tensors = results[0], server._tensors
    assert "version 2" in said, said
    assert "no server took it" in said, said
    assert await server.receive(timeout=PATIENCE) == 1
    with pytest.raises(TimeoutError):
        await server.receive(timeout=1.0)  # version 2 never whole: not exposed
    for name, value in full(1).items():
        assert torch.equal(server_tensors[name], value), name


async def test_a_stalled_server_is_dropped_and_the_push_past_its_deadline_still_gathers(
    channel: Channel,
) -> None:
    """A whole server that stops taking buckets holds the round's broadcasts up past the
    push's deadline: the trainer ranks' shares must still be taken then (the lane's ops
    are not bound by the fleet's deadline), so the stalled server is dropped and the
    other takes the version, where the push raised "a trainer rank's shares of the
    weights did not come" before (an exchange given the 0.001 s left)."""
    servers: dict[str, Any] = {}
    ready = anyio.Event()

    async def trainer(gang: Gang) -> list[PushReport]:
        tensors = shards(gang.rank, gang.size, 0)
        publisher = await open_trainer(channel, gang, tensors)
        await ready.wait()
        reports = []
        for version in (1, 2, 3):
            write(tensors, gang.rank, gang.size, version)
            if version == 2 and gang.rank == 0:
                channel.epochs.stall(servers["late"]._me.uid)
            reports.append(await publisher.push(version, timeout=0.5))
        await publisher.close()
        return reports

    async def open_servers() -> None:
        for name in ("good", "late"):
            servers[name] = await whole_server(channel, name)
        ready.set()

    async with anyio.create_task_group() as group:
        group.start_soon(open_servers)
        by_rank = await FakeWorld(2).run(trainer)
    assert by_rank[0] == by_rank[1]
    first, stalled, after = by_rank[0]
    assert first.delivered == ("good", "late"), first
    assert stalled.delivered == ("good",), stalled
    assert stalled.dropped["late"].startswith("stalled"), stalled
    assert after.delivered == ("good",), after
    assert await servers["good"].receive(timeout=PATIENCE) == 3
    for name, value in full(3).items():
        assert torch.equal(servers["good"]._tensors[name], value), name


@pytest.mark.parametrize("cancelled", [(0, 1), (0,), (1,)], ids=["both", "rank0", "rank1"])
async def test_a_push_cancelled_on_any_rank_tears_nothing_and_the_next_one_goes_on(
    channel: Channel, cancelled: tuple[int, ...]
) -> None:
    """Cancelled mid-push on every rank, on rank 0 alone or on rank 1 alone: the ranks
    keep their lane in step (``gathering`` rule 5, ``following`` rule 4), the ranks
    not cancelled raise saying why, and the next push delivers whole."""
    world = FakeWorld(2, latency=0.005)  # each of the lane's ops takes 5 ms

    async def trainer(gang: Gang, ready: anyio.Event) -> tuple[str, PushReport]:
        tensors, publisher = await pushed_once(channel, gang, ready)
        write(tensors, gang.rank, gang.size, 2)
        outcome = "pushed"
        if gang.rank in cancelled:
            with anyio.move_on_after(0.03) as scope:
                await publisher.push(2)
            outcome = "cancelled" if scope.cancelled_caught else "pushed"
        else:
            try:
                await publisher.push(2)
            except GangError as error:
                outcome = f"raised: {error}"
        write(tensors, gang.rank, gang.size, 3)
        last = await publisher.push(3)
        await publisher.close()
        return outcome, last

    results, server = await run_with_server(channel, world, trainer)
    assert results[0][1] == results[1][1], results  # the same report for version 3
    assert results[0][1].delivered == ("whole",), results
    for rank, (outcome, _) in enumerate(results):
        if rank in cancelled:
            assert outcome in ("cancelled", "pushed"), outcome
        else:  # rank 0's cancel may come after the push's words were said
            assert outcome == "pushed" or "cancelled" in outcome, outcome
    assert await server.receive(timeout=PATIENCE) == 3
    for name, value in full(3).items():
        assert torch.equal(server._tensors[name], value), name


async def test_a_rank_that_pushes_once_more_than_rank_0_is_told_it_closed(
    channel: Channel,
) -> None:
    """Rank 0 closes its publisher where rank 1 pushes once more: rank 1 raises
    ``GangClosedError`` at once, not at its deadline (``following`` rule 5), and
    nothing is left holding either rank's memory (the suite's check of busy ranges)."""
    world = FakeWorld(2)

    async def trainer(gang: Gang, ready: anyio.Event) -> str:
        _, publisher = await pushed_once(channel, gang, ready)
        if gang.rank == 0:
            await publisher.close()
            return "closed"
        started = anyio.current_time()
        with pytest.raises(GangClosedError, match="closed"):
            await publisher.push(2, timeout=30.0)
        took = anyio.current_time() - started
        await publisher.close()
        return f"raised after {took:.1f} s"

    results, _ = await run_with_server(channel, world, trainer)
    assert results[0] == "closed", results
    assert float(results[1].split()[2]) < 10.0, results  # not at its 30 s deadline


async def test_a_report_too_long_for_the_done_word_follows_it_whole(channel: Channel) -> None:
    """A push's report longer than the ``DONE`` word holds (``gathering`` rule 2: nine
    servers of 128-character names) follows the word in an op of its own: every rank
    returns the same report, and the next push (its words in step) too."""
    names = [f"{index}" + "s" * 127 for index in range(9)]
    assert len(",".join(names)) > INLINE_BYTES
    world = FakeWorld(2)
    ready = anyio.Event()
    servers: dict[str, Any] = {}

    async def trainer(gang: Gang) -> list[PushReport]:
        tensors = shards(gang.rank, gang.size, 1)
        publisher = await open_trainer(channel, gang, tensors)
        await ready.wait()
        reports = [await publisher.push(1)]
        write(tensors, gang.rank, gang.size, 2)
        reports.append(await publisher.push(2))
        await publisher.close()
        return reports

    async def open_servers() -> None:
        for name in names:
            servers[name] = await whole_server(channel, name)
        ready.set()

    async with anyio.create_task_group() as group:
        group.start_soon(open_servers)
        results = await world.run(trainer)
    assert results[0] == results[1], results
    assert [sorted(report.delivered) for report in results[0]] == [sorted(names)] * 2
    for server in servers.values():
        assert await server.receive(timeout=PATIENCE) == 2
        for name, value in full(2).items():
            assert torch.equal(server._tensors[name], value), name
