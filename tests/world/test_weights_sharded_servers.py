"""Sharded servers in one process (``agang._weights.relay``, ``relayed``): a server gang
of FakeWorld ranks, each holding its slices (``agang.Sharded`` along dimensions 0 and 1,
and plain tensors), subscribed to the channel of a 2-rank sharded trainer beside a
whole server, through the production publisher and subscribers on the in-process
channel of ``tests/support/weightsworld.py``. The same over real processes:
``tests/gloo/test_weights_sharded.py``."""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
import torch
from test_weights_sharded import full, open_trainer, shards, write
from weightsworld import Channel

from agang import GangError, GangInitError, PushReport, Sharded
from agang._gang import Gang
from agang._weights import channel as channel_keys
from agang._weights import over_gang, subscriber
from agang._weights import relay as relay_module
from agang._weights.plan import FIRST_BUCKET_BYTES
from agang._weights.publisher import WeightPublisher
from agang._weights.relay import Relay
from agang._weights.relayed import Relayed
from agang._weights.sharding import Layout
from agang._weights.subscriber import WeightSubscriber
from agang.testing import FakeWorld

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60), pytest.mark.usefixtures("short_beats")]

PATIENCE = 10.0


async def open_server(
    channel: Channel,
    gang: Gang,
    tensors: dict[str, Any],
    in_place: bool = False,
    name: str | None = "sharded",
    timeout: float = 10.0,  # noqa: ASYNC109
) -> WeightSubscriber:
    """A sharded server's rank: every rank opens together (collective)."""
    opened = await WeightSubscriber._open_over(
        gang, tensors, "127.0.0.1:1", "c", name, timeout, in_place, None, lambda _: channel.site
    )
    channel.opened.append(opened)
    return opened


def local(tensors: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.tensor if isinstance(v, Sharded) else v for k, v in tensors.items()}


def slice_bytes(tensors: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in local(tensors).values())


class Fleet:
    """A 2-rank sharded trainer, a whole server and a 2-rank sharded server, opened."""

    def __init__(self) -> None:
        self.trainers = FakeWorld(2)
        self.servers = FakeWorld(2)
        self.trainer_tensors = [shards(rank, 2, 0) for rank in range(2)]
        self.server_tensors = [
            {k: _zeroed(v) for k, v in shards(rank, 2, 0).items()} for rank in range(2)
        ]
        self.publishers: list[Any] = []
        self.sharded: list[WeightSubscriber] = []
        self.whole: Any = None

    async def open(
        self, channel: Channel, bucket_bytes: int = 1024, in_place: bool = False
    ) -> None:
        async def trainer(gang: Gang) -> Any:
            tensors = self.trainer_tensors[gang.rank]
            return await open_trainer(channel, gang, tensors, bucket_bytes)

        async def servers() -> None:
            whole = {k: torch.zeros_like(v) for k, v in full(0).items()}
            self.whole = await channel.subscriber(whole, "whole")

            async def rank(gang: Gang) -> WeightSubscriber:
                tensors = self.server_tensors[gang.rank]
                return await open_server(channel, gang, tensors, in_place)

            self.sharded = await self.servers.run(rank)

        async with anyio.create_task_group() as group:
            group.start_soon(servers)
            self.publishers = await self.trainers.run(trainer)

    async def push(self, version: int) -> PushReport:
        async def one(gang: Gang) -> PushReport:
            write(self.trainer_tensors[gang.rank], gang.rank, 2, version)
            return await self.publishers[gang.rank].push(version, timeout=5.0)

        reports = await self.trainers.run(one)
        assert reports[0] == reports[1]
        return reports[0]  # type: ignore[no-any-return]

    async def receive(self) -> list[int]:
        async def one(gang: Gang) -> int:
            return await self.sharded[gang.rank].receive(timeout=PATIENCE)

        return await self.servers.run(one)

    def assert_holds(self, version: int) -> None:
        for rank in range(2):
            expected = local(shards(rank, 2, version))
            for name, value in local(self.server_tensors[rank]).items():
                assert torch.equal(value, expected[name]), (rank, name)


def _zeroed(value: Any) -> Any:
    if isinstance(value, Sharded):
        return Sharded(torch.zeros_like(value.tensor), value.dim, value.shape)
    return torch.zeros_like(value)


@pytest.mark.parametrize("in_place", [False, True], ids=["staged", "in_place"])
async def test_a_sharded_server_and_a_whole_one_take_exact_bytes_each_rank_its_slice(
    channel: Channel, in_place: bool
) -> None:
    world = Fleet()
    await world.open(channel, in_place=in_place)
    for version in (1, 2):
        report = await world.push(version)
        assert sorted(report.delivered) == ["sharded", "whole"], report
        assert await world.receive() == [version, version]
        world.assert_holds(version)
        assert await world.whole.receive(timeout=PATIENCE) == version
        for name, value in full(version).items():
            assert torch.equal(world.whole._tensors[name], value), name
    # Each rank stages its slice, never the whole model (rank 0 also holds the relay's
    # buffers: bucket 0 and a ring of two buckets, and a scratch one for Shard(1)).
    model = sum(v.numel() * v.element_size() for v in full(0).values())
    for rank, server in enumerate(world.sharded):
        staged = server._over.staging if server._over else {}
        assert {k: v.shape for k, v in staged.items()} == {
            k: v.shape for k, v in local(world.server_tensors[rank]).items()
        }
        mine = 0 if in_place else slice_bytes(world.server_tensors[rank])
        assert slice_bytes(world.server_tensors[rank]) < model
        if rank:
            assert server.staging_bytes == mine
        else:
            assert mine < server.staging_bytes <= mine + 4 * 1024


async def test_rank_0_of_a_sharded_server_holds_its_slice_and_a_few_buckets(
    channel: Channel,
) -> None:
    """A 2 MiB model in 64 KiB buckets: rank 0 holds its 1 MiB slice and four buckets."""
    bucket = 64 * 1024
    whole = torch.arange(2 * 1024 * 1024 // 4, dtype=torch.float32).reshape(-1, 64)
    trainers, servers = FakeWorld(2), FakeWorld(2)

    def mine(rank: int, value: torch.Tensor) -> dict[str, Any]:
        return {"w": Sharded(torch.chunk(value, 2)[rank].clone(), 0, tuple(whole.shape))}

    held = [mine(rank, torch.zeros_like(whole)) for rank in range(2)]
    opened: list[Any] = []

    async def open_servers() -> None:
        opened.extend(await servers.run(lambda gang: open_server(channel, gang, held[gang.rank])))

    async def trainer(gang: Gang) -> Any:
        return await open_trainer(channel, gang, mine(gang.rank, whole), bucket)

    async with anyio.create_task_group() as group:
        group.start_soon(open_servers)
        publishers = await trainers.run(trainer)
    reports = await trainers.run(lambda gang: publishers[gang.rank].push(1))
    assert reports[0].delivered == ("sharded",)
    assert await servers.run(lambda gang: opened[gang.rank].receive(timeout=PATIENCE)) == [1, 1]
    for rank in range(2):
        assert torch.equal(held[rank]["w"].tensor, torch.chunk(whole, 2)[rank])
    slice_ = whole.numel() * 4 // 2
    assert opened[1].staging_bytes == slice_
    assert opened[0].staging_bytes <= slice_ + min(bucket, FIRST_BUCKET_BYTES) + 3 * bucket


async def test_a_sharded_server_rank_lost_drops_that_server_alone_naming_the_rank(
    channel: Channel,
) -> None:
    world = Fleet()
    await world.open(channel)
    report = await world.push(1)
    assert sorted(report.delivered) == ["sharded", "whole"], report
    assert await world.receive() == [1, 1]
    await world.sharded[1].close()  # rank 1 lost: its lanes closed, its rounds ended
    report = await world.push(2)
    assert report.delivered == ("whole",), report
    assert "server rank 1" in report.dropped["sharded"], report.dropped
    assert await world.whole.receive(timeout=PATIENCE) == 2
    for name, value in full(2).items():
        assert torch.equal(world.whole._tensors[name], value), name
    with pytest.raises(GangError, match="server rank 1"):
        await world.sharded[0].receive(timeout=PATIENCE)
    world.assert_holds(1)  # the version it returned last stays whole
    status = world.sharded[0]._service.status  # what the publisher's probe reads
    assert status.startswith("ended: "), status
    assert "server rank 1" in status, status


@pytest.mark.parametrize("alone", [0, 1])
async def test_a_receive_one_rank_gave_up_on_keeps_the_ranks_in_step(
    channel: Channel, alone: int
) -> None:
    """Rank ``alone`` calls ``receive`` and times out waiting for the other, then is
    cancelled waiting again: its exchange stays on the lane, and the next ``receive``
    of both ranks takes the version up (``agang._weights.server_rank`` rule 2)."""
    world = Fleet()
    await world.open(channel)
    await world.push(1)
    with pytest.raises(TimeoutError, match="newer than None"):
        await world.sharded[alone].receive(timeout=0.3)
    with anyio.move_on_after(0.2):
        await world.sharded[alone].receive()
    assert world.sharded[alone].version is None
    assert await world.receive() == [1, 1]
    world.assert_holds(1)
    await world.push(2)
    assert await world.receive() == [2, 2]
    world.assert_holds(2)


async def test_three_server_ranks_that_hold_every_tensor_whole_each_take_all_of_it(
    channel: Channel,
) -> None:
    """Plain tensors on a sharded server are every rank's: each of three gets them whole."""
    trainers, servers = FakeWorld(2), FakeWorld(3)
    held = [{k: torch.zeros_like(v) for k, v in full(0).items()} for _ in range(3)]
    trainer_tensors = [shards(rank, 2, 0) for rank in range(2)]
    opened: list[Any] = []

    async def open_servers() -> None:
        opened.extend(await servers.run(lambda gang: open_server(channel, gang, held[gang.rank])))

    async def trainer(gang: Gang) -> Any:
        return await open_trainer(channel, gang, trainer_tensors[gang.rank])

    async with anyio.create_task_group() as group:
        group.start_soon(open_servers)
        publishers = await trainers.run(trainer)

    async def push(gang: Gang) -> PushReport:
        write(trainer_tensors[gang.rank], gang.rank, 2, 1)
        return await publishers[gang.rank].push(1)

    report = (await trainers.run(push))[0]
    assert report.delivered == ("sharded",), report
    assert await servers.run(lambda gang: opened[gang.rank].receive(timeout=PATIENCE)) == [1] * 3
    for rank in range(3):
        for name, value in full(1).items():
            assert torch.equal(held[rank][name], value), (rank, name)


async def test_a_whole_publishers_channel_refuses_a_sharded_server_on_every_rank(
    channel: Channel,
) -> None:
    await channel.publisher(full(0), bucket_bytes=1024)
    servers = FakeWorld(2)
    tensors = [shards(rank, 2, 0) for rank in range(2)]

    async def rank(gang: Gang) -> str:
        with pytest.raises(ValueError, match="not split") as refused:
            await open_server(channel, gang, tensors[gang.rank])
        return str(refused.value)

    said = await servers.run(rank)
    assert all("Rank 0" in s for s in said), said


class _NoEpochGang:
    """An epoch's gang whose broadcasts end at once (the bytes do not matter here)."""

    def broadcast(self, tensor: torch.Tensor, root: int, timeout: float | None = None) -> Any:
        return tensor


async def test_a_relay_round_that_stops_part_way_ends_on_the_lane_and_the_next_one_goes_on() -> (
    None
):
    """``relay`` rule 2: the publisher moves on after bucket 2 of 8 (a fleet's hiccup):
    rank 0 still ends the round on the lane (zeros, then ``ABORT``), the other rank
    marks no version ready, and the next round is whole on both."""
    whole = torch.arange(4096, dtype=torch.float32).reshape(-1, 16)

    async def rank(gang: Gang) -> tuple[Any, ...]:
        mine = torch.chunk(whole, 2)[gang.rank].clone()
        layouts = [Layout.of("w", Sharded(mine, 0, tuple(whole.shape)), gang.rank, 2)]
        plan = over_gang.plan_of(["w"], layouts, 1024, "gloo")
        lane = await gang.lane("relay")
        if gang.rank == 1:
            relayed = Relayed(plan, layouts, lane, "s", 10.0)
            seen = []
            for _ in range(200):  # bounded: the two rounds take milliseconds
                seen.append(relayed.ready)
                if relayed.ready == 2 or relayed.error is not None:
                    break
                await anyio.sleep(0.02)
            error, ready = relayed.error, relayed.ready
            relayed.stop(2.0)
            return (error, 1 in seen, ready)
        relay = Relay(plan, layouts, lane, 2)
        bucket0 = torch.zeros(relay.first_bytes, dtype=torch.uint8)
        looks = 0

        async def moves_on_at_the_third(handles: list[Any]) -> str | None:
            nonlocal looks
            looks += 1
            return "the publisher moved on" if looks == 3 else None

        async def stays(handles: list[Any]) -> str | None:
            return None

        epoch = _NoEpochGang()
        first = await relay.round(epoch, bucket0, 1, 1, moves_on_at_the_third, 10.0)  # type: ignore[arg-type]
        second = await relay.round(epoch, bucket0, 2, 2, stays, 10.0)  # type: ignore[arg-type]
        await anyio.sleep(0.5)
        await anyio.to_thread.run_sync(relay.close, "the test ended", False)  # off the loop
        return (first, second, relay.broken)

    (first, second, broken), (error, saw_one, ready) = await FakeWorld(2).run(rank)
    assert first == "the publisher moved on"
    assert second is None
    assert broken is None
    assert error is None
    assert not saw_one  # the stopped round's version was never ready
    assert ready == 2


async def test_an_argument_refused_on_one_rank_is_refused_on_all_and_opens_stay_in_step() -> None:
    """A sharded server's ``open`` checks every argument on every rank before its lanes
    are made, and the ranks agree: a bad ``store`` on rank 1 alone is refused on both,
    naming rank 1, and the next ``open`` of both ranks meets (here, to find no store)."""
    whole = torch.zeros(8, 4)

    async def rank(gang: Gang) -> list[str]:
        tensors = {"w": Sharded(torch.chunk(whole, 2)[gang.rank].clone(), 0, (8, 4))}
        said = []
        for attempt in range(2):
            store = "bad" if (gang.rank == 1 and attempt == 0) else "127.0.0.1:1"
            try:
                await WeightSubscriber.open(
                    tensors, store=store, channel="c", timeout=1.0, gang=gang
                )
                said.append("opened")
            except (ValueError, GangError) as error:
                said.append(f"{type(error).__name__}: {error}")
        return said

    with anyio.fail_after(30):
        (first0, second0), (first1, second1) = await FakeWorld(2).run(rank)
    assert first0 == first1, (first0, first1)
    assert first0.startswith("ValueError: Rank 1 of the gang"), first0
    assert "`store`" in first0, first0
    assert second0.split(":")[0] == second1.split(":")[0] == "GangInitError", (second0, second1)


# --- A sharded server's open ends the same on every rank (subscriber rule 6) ----------


async def _open_beside_a_trainer(
    channel: Channel,
    server: Callable[[Gang], Awaitable[Any]],
    trainer_after: float = 0.0,
) -> tuple[list[Any], list[Any]]:
    """``server(gang)`` on each rank of a 2-rank server gang, beside a 2-rank sharded
    trainer that opens ``trainer_after`` seconds later; (the servers', the trainers')."""
    trainers, servers = FakeWorld(2), FakeWorld(2)
    tensors = [shards(rank, 2, 0) for rank in range(2)]
    said: list[Any] = []

    async def open_servers() -> None:
        said.extend(await servers.run(server))

    async with anyio.create_task_group() as group:
        group.start_soon(open_servers)
        await anyio.sleep(trainer_after)
        publishers = await trainers.run(
            lambda gang: open_trainer(channel, gang, tensors[gang.rank])
        )
    return said, publishers


def _held() -> list[dict[str, Any]]:
    return [{k: _zeroed(v) for k, v in shards(rank, 2, 0).items()} for rank in range(2)]


async def test_rank_0_failing_to_join_the_channel_fails_every_ranks_open_naming_it(
    channel: Channel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 found the plan and the ranks agreed on it, then the store refused its
    registration: rank 1's ``open`` raises the same error, naming rank 0 and why (it
    returned a subscriber whose ``receive`` waited for rounds that never came), and no
    thread of either rank stays behind (the fixture)."""

    def refuse(self: Any, member: Any) -> int:
        raise GangError("the store refused the registration")

    monkeypatch.setattr(channel_keys.Channel, "register", refuse)
    held = _held()

    async def server(gang: Gang) -> str:
        try:
            opened = await open_server(channel, gang, held[gang.rank])
        except GangInitError as error:
            return str(error)
        await opened.close()
        return "opened"

    with anyio.fail_after(30):
        said, _ = await _open_beside_a_trainer(channel, server)
    assert said[0] == said[1], said
    assert said[0].startswith("Server rank 0 of the gang"), said[0]
    assert "the store refused the registration" in said[0], said[0]


async def test_with_no_timeout_the_other_ranks_wait_for_rank_0_as_long_as_it_takes(
    channel: Channel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``timeout=math.inf``: rank 0 waits for the publisher with no bound, and so does
    rank 1 for rank 0 (it waited ``following_bound``, 150 s, then failed alone while
    rank 0 went on); here that bound is made 0.3 s, and the publisher comes after 1 s."""
    monkeypatch.setattr(over_gang, "following_bound", lambda seconds: 0.3)
    held = _held()

    async def server(gang: Gang) -> WeightSubscriber:
        return await open_server(channel, gang, held[gang.rank], timeout=math.inf)

    with anyio.fail_after(30):
        servers, publishers = await _open_beside_a_trainer(channel, server, trainer_after=1.0)
    reports = await FakeWorld(2).run(lambda gang: publishers[gang.rank].push(1, timeout=5.0))
    assert reports[0].delivered == ("sharded",), reports[0]
    got = await FakeWorld(2).run(lambda gang: servers[gang.rank].receive(timeout=PATIENCE))
    assert got == [1, 1]


async def test_rank_0_that_gives_up_its_open_ends_the_others_wait_with_no_timeout(
    channel: Channel,
) -> None:
    """``timeout=math.inf`` and no publisher: rank 0's ``open`` is cancelled (it would
    wait for ever); it tells rank 1, whose ``open`` raises at once, naming rank 0 (it
    waited 150 s)."""
    held = _held()

    async def server(gang: Gang) -> str:
        try:
            with anyio.move_on_after(0.5 if gang.rank == 0 else 60.0):
                await open_server(channel, gang, held[gang.rank], timeout=math.inf)
                return "opened"
        except GangInitError as error:
            return str(error)
        return "cancelled"

    with anyio.fail_after(20):
        said = await FakeWorld(2).run(server)
    assert said[0] == "cancelled"
    assert said[1].startswith("Server rank 0 found no plan: its open was cancelled"), said


async def test_every_rank_of_a_server_opened_with_no_name_takes_rank_0s(
    channel: Channel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``name=None``: each rank made its own ``HOST:PID``; the server's name is its rank
    0's, the channel's member's, on every rank (here each call names a new process)."""
    names = iter(f"host:{pid}" for pid in range(100, 200))
    monkeypatch.setattr(subscriber, "default_name", lambda: next(names))
    held = _held()

    async def server(gang: Gang) -> WeightSubscriber:
        return await open_server(channel, gang, held[gang.rank], name=None)

    with anyio.fail_after(30):
        servers, _ = await _open_beside_a_trainer(channel, server)
    assert servers[0].name.startswith("host:")
    assert servers[1].name == servers[0].name


# --- The relay lane (relay rules 5, 6; relayed rule 1) ---------------------------------


def _relay_plan(gang: Gang, rows: int) -> tuple[Any, list[Layout]]:
    """A ``rows`` x 16 float32 tensor sharded along dimension 0, in 1 KiB buckets."""
    whole = torch.arange(rows * 16, dtype=torch.float32).reshape(-1, 16)
    mine = torch.chunk(whole, 2)[gang.rank].clone()
    layouts = [Layout.of("w", Sharded(mine, 0, tuple(whole.shape)), gang.rank, 2)]
    return over_gang.plan_of(["w"], layouts, 1024, "gloo"), layouts


async def test_a_stuck_rank_is_named_within_a_bound_of_one_op_not_of_the_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 1 takes nothing from the lane (a stopped process): rank 0's round breaks
    within ``RELAY_SECONDS`` plus one op's bytes, naming rank 1. Here the lane is made
    slow (10 KB/s, 0.2 s) and the version 64 KiB: the version's bound was 6.8 s."""
    monkeypatch.setattr(relay_module, "RELAY_SECONDS", 0.2)
    monkeypatch.setattr(relay_module, "RELAY_BYTES_PER_SECOND", 1e4)
    done = anyio.Event()

    async def rank(gang: Gang) -> Any:
        plan, layouts = _relay_plan(gang, 1024)
        lane = await gang.lane("relay")
        if gang.rank == 1:  # stuck: it never takes a word
            await done.wait()
            lane.close_sync()
            return None
        relay = Relay(plan, layouts, lane, 2)
        bucket0 = torch.zeros(relay.first_bytes, dtype=torch.uint8)

        async def stays(handles: list[Any]) -> str | None:
            return None

        began = time.monotonic()
        try:
            with pytest.raises(GangError):  # the lane's; ``broken`` names the rank
                await relay.round(_NoEpochGang(), bucket0, 1, 1, stays, 60.0)  # type: ignore[arg-type]
            return time.monotonic() - began, relay.broken
        finally:
            done.set()
            await anyio.to_thread.run_sync(relay.close, "the test ended", False)

    with anyio.fail_after(30):
        (took, broken), _ = await FakeWorld(2).run(rank)
    assert "server rank 1" in broken
    assert took < 2.0, took


class _Counting:
    """A lane that counts a rank's share receives in flight (its control words aside)."""

    def __init__(self, lane: Gang) -> None:
        self._lane = lane
        self._posted: list[Any] = []
        self.most = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lane, name)

    def recv(self, tensor: torch.Tensor, source: int, timeout: float | None = None) -> Any:
        handle = self._lane.recv(tensor, source, timeout=timeout)
        if tensor.dtype == torch.float32:
            self._posted.append(handle)
            self.most = max(self.most, sum(not h.done() for h in self._posted))
        return handle


async def test_a_rank_has_at_most_two_buckets_receives_in_flight() -> None:
    """``relayed`` rule 1: while rank 0 waits for each bucket (0.1 s here), rank 1 has
    at most two buckets' receives posted (it posted a third before it awaited the first)."""

    # As in a server: the relay closes off the loop (its close waits for its words), and
    # rank 1 stops its thread once rank 0 closed (the stop blocks the ranks' one loop).
    closed = anyio.Event()

    async def rank(gang: Gang) -> Any:
        plan, layouts = _relay_plan(gang, 64 * 6)
        lane = await gang.lane("relay")
        if gang.rank == 1:
            counting = _Counting(lane)
            relayed = Relayed(plan, layouts, counting, "s", 10.0)  # type: ignore[arg-type]
            for _ in range(300):
                if relayed.ready == 1 or relayed.error is not None:
                    break
                await anyio.sleep(0.02)
            await closed.wait()
            relayed.stop(2.0)
            return relayed.ready, counting.most
        relay = Relay(plan, layouts, lane, 2)
        bucket0 = torch.zeros(relay.first_bytes, dtype=torch.uint8)

        async def slowly(handles: list[Any]) -> str | None:
            await anyio.sleep(0.1)
            return None

        assert relay.count >= 5
        moved = await relay.round(_NoEpochGang(), bucket0, 1, 1, slowly, 10.0)  # type: ignore[arg-type]
        await anyio.sleep(0.3)
        await anyio.to_thread.run_sync(relay.close, "the test ended", False)  # off the loop
        closed.set()
        return moved

    with anyio.fail_after(30):
        moved, (ready, most) = await FakeWorld(2).run(rank)
    assert moved is None
    assert ready == 1
    assert most == 2, most


async def test_pushes_over_gangs_on_both_sides_leave_the_store_as_it_was(channel: Channel) -> None:
    """The store does not grow with pushes (``channel`` rule 6) where both sides are
    gangs: after three pushes, ten more leave its keys as they were and its bytes
    within a few digits' worth (versions and epochs in the records)."""
    world = Fleet()
    await world.open(channel)
    for version in range(1, 14):
        if version == 4:
            before = _store_keys(channel.store)
        report = await world.push(version)
        assert sorted(report.delivered) == ["sharded", "whole"], report
        assert await world.receive() == [version, version]
    after = _store_keys(channel.store)
    world.assert_holds(13)
    assert after[0] == before[0], (before, after)
    assert after[1] <= before[1] + 64, (before, after)


def _store_keys(store: Any) -> tuple[int, int]:
    """The keys ``store`` holds, and their bytes."""
    count = size = 0
    for name in store.list_keys():
        if store.check([name]):  # a key may go between the list and the read
            size += len(store.get(name))
            count += 1
    return count, size


async def test_rank_0_closed_alone_tells_the_other_ranks_why_and_its_status_says_ended(
    channel: Channel,
) -> None:
    """``relay`` rule 6, ``service`` rule 8: rank 0's subscriber closed alone ends rank
    1's rounds with rank 0's reason (it said only that its lane closed), and rank 0's
    service's status says it ended."""
    world = Fleet()
    await world.open(channel)
    await world.push(1)
    assert await world.receive() == [1, 1]
    await world.sharded[0].close()
    assert world.sharded[0]._service.status == "ended: subscriber 'sharded' was closed"
    with pytest.raises(GangError) as raised:
        await world.sharded[1].receive(timeout=PATIENCE)
    assert "ended with its rank 0, the channel's member: subscriber 'sharded' was closed" in (
        str(raised.value)
    ), raised.value
    world.assert_holds(1)


# --- The vote and the copy (server_rank rule 1) ----------------------------------------


async def test_a_receive_that_times_out_in_the_vote_still_copies_as_every_rank_does(
    channel: Channel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 comes to the vote 0.5 s late; rank 0's ``receive`` times out (0.2 s)
    meanwhile, after the exchange, in the vote: the vote and the copy run shielded and
    bounded, so both ranks copy version 1 and return it, and neither tensors nor
    ``version`` differ across the ranks; the next push goes on as usual."""
    world = Fleet()
    await world.open(channel)
    await world.push(1)
    late = world.sharded[1]._over
    assert late is not None
    take = late._take

    async def late_take(version: int) -> bool:
        await anyio.sleep(0.5)
        return await take(version)

    monkeypatch.setattr(late, "_take", late_take)

    async def one(gang: Gang) -> int | None:
        if gang.rank == 0:
            await anyio.sleep(0.1)  # rank 1 asks first: rank 0's exchange ends at once
            return await world.sharded[0].receive(timeout=0.2)
        return await world.sharded[1].receive(timeout=PATIENCE)

    assert await world.servers.run(one) == [1, 1]
    assert [s.version for s in world.sharded] == [1, 1]
    world.assert_holds(1)
    monkeypatch.setattr(late, "_take", take)
    await world.push(2)
    assert await world.receive() == [2, 2]
    world.assert_holds(2)


@pytest.mark.parametrize("side", ["publisher", "subscriber"])
async def test_a_side_that_one_rank_never_opens_raises_in_its_timeout(
    channel: Channel, side: str
) -> None:
    """``open`` over a gang is a collective call (``over_gang`` rule 3): where rank 1
    never opens, rank 0's ``open`` raises ``GangInitError`` within its timeout, saying
    which side and how long it waited, instead of waiting for the lane for good."""
    world = FakeWorld(2)

    async def rank(gang: Gang) -> str:
        if gang.rank == 1:
            return "never opened"
        tensors = {k: torch.zeros_like(v) for k, v in full(0).items()}
        started = time.monotonic()
        opening: Awaitable[Any] = (
            WeightPublisher._open_over(
                gang, tensors, "127.0.0.1:1", "c", 0.3, 1024, None, lambda _: channel.site
            )
            if side == "publisher"
            else open_server(channel, gang, tensors, timeout=0.3)
        )
        with pytest.raises(GangInitError) as raised:
            await opening
        assert time.monotonic() - started < 5.0
        return str(raised.value)

    said = (await world.run(rank))[0]
    what = "the weights channel 'c'" if side == "publisher" else "subscriber 'sharded'"
    assert f"opened {what} within 0.3 s" in said, said
    assert "collective call" in said, said
