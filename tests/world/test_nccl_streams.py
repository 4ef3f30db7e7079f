"""Streams on the NCCL paths: GradientSync's device work follows the user's streams (L4),
and agang's side streams are its own, never drawn from torch's pool (L5).

L4 runs on ``agang.testing.SimulatedNccl``, whose streams hold device work in order as a
GPU's do (``sim.hold`` stands in for compute still running on a stream). L5 drives the
production ``TorchCudaRuntime`` against doubles of torch's stream pool and of libcudart.
Timing bounds leave 10x margins: the right behaviour waits for a release that never
comes on its own, the wrong one finishes in milliseconds.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import pytest
import torch

from agang import GradientSync, ProcessGroupGang
from agang._backends.cuda.runtime import TorchCudaRuntime
from agang._backends.cuda.streams import PrivateStreams
from agang.testing import SimulatedNccl

BOUND = 30.0  # seconds: no test may hang longer


@pytest.fixture
async def sim() -> AsyncIterator[SimulatedNccl]:
    simulation = SimulatedNccl(2, watchdog_timeout=20.0)
    yield simulation
    simulation.close()


def _models() -> list[torch.nn.Module]:
    """Two replicas with different weights: ranks 0 and 1 before the broadcast."""
    models = []
    for rank in range(2):
        torch.manual_seed(rank)
        models.append(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))
    return models


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


async def _reached(event: Any, seconds: float = 10.0) -> bool:
    """Whether the simulated stream got to ``event`` within ``seconds``."""
    started = time.monotonic()
    while not event.query() and time.monotonic() - started < seconds:  # noqa: ASYNC110  # a device event: nothing to await
        await anyio.sleep(0.01)
    return bool(event.query())


async def _close(*gangs: ProcessGroupGang) -> None:
    for gang in gangs:
        await gang.close()


@pytest.mark.anyio
async def test_l4_ready_copies_the_parameters_on_the_callers_stream(sim: SimulatedNccl) -> None:
    """The broadcast parameters are written by device work on the stream current where
    ``ready()`` ran, not on an agang thread's stream (where a forward pass on the user's
    stream would race it): while that stream is held, rank 1 still has its own weights."""
    gangs = sim.gangs()
    models = _models()
    streams = [sim.stream(rank) for rank in range(2)]
    with anyio.fail_after(BOUND), contextlib.ExitStack() as stack:
        for rank in range(2):
            stack.enter_context(sim.use_stream(rank, streams[rank]))
        syncs = [GradientSync(m, g) for m, g in zip(models, gangs, strict=True)]
        releases = [sim.hold(rank) for rank in range(2)]  # compute still running there
        for sync in syncs:
            await sync.ready()
        assert not torch.equal(_flat(models[1]), _flat(models[0]))
        for release in releases:
            release()
        assert await _reached(sim.record_event(1))
        assert torch.equal(_flat(models[1]), _flat(models[0]))
    await _close(*gangs)


@pytest.mark.anyio
async def test_l4_wait_orders_the_callers_stream_after_every_bucket(sim: SimulatedNccl) -> None:
    """Stream-ordered mode: buckets issued from backward are ordered on backward's
    stream, so ``wait()`` makes the caller's current stream wait for them too, as DDP's
    finalize does; otherwise reading ``.grad`` there races the all-reduce."""
    gangs = sim.gangs(stream_ordered=True)
    models = _models()
    with anyio.fail_after(BOUND):
        syncs = [GradientSync(m, g) for m, g in zip(models, gangs, strict=True)]
        for sync in syncs:
            await sync.ready()
        sim.synchronize(0)
        sim.synchronize(1)
        backward = [sim.stream(rank) for rank in range(2)]
        sim.pause(1)  # rank 1's device is behind: the all-reduce cannot run yet
        for rank, model in enumerate(models):
            with sim.use_stream(rank, backward[rank]):
                model(torch.full((2, 4), float(rank + 1))).sum().backward()
        for sync in syncs:
            await sync.wait()  # returns once ordered
        caller = sim.record_event(0)  # the caller's (default) stream, after wait()
        await anyio.sleep(0.3)
        assert not caller.query()
        sim.resume(1)
        assert await _reached(caller)
        assert await _reached(sim.record_event(1))
        assert torch.equal(_grads(models[0]), _grads(models[1]))
    await _close(*gangs)


@pytest.mark.anyio
async def test_l4_a_bucket_issued_at_backwards_end_follows_backwards_stream(
    sim: SimulatedNccl,
) -> None:
    """A bucket with a parameter that got no gradient is issued at the end of backward
    (autograd's callback), not by a hook of its own; its all-reduce must still come after
    the work on the stream its gradients came from, so ``wait()`` cannot finish while
    that stream is held."""
    gangs = sim.gangs()
    models = _models()
    with anyio.fail_after(BOUND):
        syncs = [GradientSync(m, g) for m, g in zip(models, gangs, strict=True)]
        for sync in syncs:
            await sync.ready()
        backward = [sim.stream(rank) for rank in range(2)]
        releases = []
        for rank, model in enumerate(models):
            with sim.use_stream(rank, backward[rank]):
                releases.append(sim.hold(rank))  # backward's device work still running
                model[0](torch.full((2, 4), float(rank + 1))).sum().backward()  # layer 1 unused
        finished: list[int] = []

        async def wait(rank: int) -> None:
            await syncs[rank].wait()
            finished.append(rank)

        async with anyio.create_task_group() as tasks:
            for rank in range(2):
                tasks.start_soon(wait, rank)
            await anyio.sleep(0.3)
            assert not finished
            for release in releases:
                release()
        assert torch.equal(_grads(models[0]), _grads(models[1]))
    await _close(*gangs)


# L5: the production runtime against doubles of torch's pool and libcudart.


class _Pool:
    """torch's stream pool: a fixed set of streams per device, handed out round-robin."""

    def __init__(self) -> None:
        self.streams = [object() for _ in range(32)]
        self.draws = 0

    def __call__(self, device: Any = None, priority: int = 0) -> object:
        stream = self.streams[self.draws % len(self.streams)]
        self.draws += 1
        return stream


class _Cudart:
    """libcudart's stream calls; records the flags and the device current at creation."""

    def __init__(self, current: list[Any]) -> None:
        self.current = current
        self.created: list[tuple[int, int, Any]] = []
        self.destroyed: list[int] = []

    def cudaStreamCreateWithFlags(self, pointer: Any, flags: int) -> int:
        handle = 0x7000 + len(self.created)
        pointer.contents.value = handle
        self.created.append((handle, flags, self.current[-1] if self.current else None))
        return 0

    def cudaStreamDestroy(self, handle: Any) -> int:
        self.destroyed.append(handle.value)
        return 0


class _External:
    def __init__(self, stream_ptr: int, device: Any = None) -> None:
        self.stream_ptr = stream_ptr
        self.device = device


class _Key:
    pass


@pytest.fixture
def cuda_doubles(monkeypatch: pytest.MonkeyPatch) -> tuple[_Pool, _Cudart]:
    current: list[Any] = []

    @contextlib.contextmanager
    def device(which: Any) -> Iterator[None]:
        current.append(which)
        try:
            yield
        finally:
            current.pop()

    pool = _Pool()
    monkeypatch.setattr(torch.cuda, "Stream", pool)
    monkeypatch.setattr(torch.cuda, "ExternalStream", _External)
    monkeypatch.setattr(torch.cuda, "device", device)
    return pool, _Cudart(current)


def test_l5_side_streams_are_private_never_from_torchs_pool(
    cuda_doubles: tuple[_Pool, _Cudart],
) -> None:
    """Each gang's side stream is made by libcudart, non-blocking, on the gang's device,
    so none of the pool's streams (NCCL's communicator streams, the user's) is ever it;
    it is destroyed with its gang."""
    pool, cudart = cuda_doubles
    runtime = TorchCudaRuntime(PrivateStreams(lambda: cudart))
    gpu = torch.device("cuda", 1)
    keys = [_Key() for _ in range(3)]
    sides = [runtime.side_stream(gpu, key) for key in keys]
    assert runtime.side_stream(gpu, keys[0]) is sides[0]  # one per gang
    draws = [torch.cuda.Stream(device=gpu) for _ in range(64)]  # type: ignore[no-untyped-call]
    assert not [s for s in sides if any(s is d for d in draws)]
    assert len({id(s) for s in sides}) == 3
    assert [flags for _, flags, _ in cudart.created] == [1, 1, 1]  # cudaStreamNonBlocking
    assert [where for _, _, where in cudart.created] == [gpu] * 3
    assert [s.stream_ptr for s in sides] == [h for h, _, _ in cudart.created]
    first = cudart.created[0][0]
    del keys[0], sides
    gc.collect()
    assert cudart.destroyed == [first]
    assert pool.draws == 64


def test_l5_without_libcudart_the_pool_is_used_with_a_warning(
    cuda_doubles: tuple[_Pool, _Cudart], caplog: pytest.LogCaptureFixture
) -> None:
    pool, _ = cuda_doubles
    runtime = TorchCudaRuntime(PrivateStreams(lambda: None))
    with caplog.at_level(logging.WARNING, logger="agang"):
        first = runtime.side_stream(torch.device("cuda", 0), _Key())
        runtime.side_stream(torch.device("cuda", 0), _Key())
    assert first is pool.streams[0]
    assert len([r for r in caplog.records if "private CUDA stream" in r.getMessage()]) == 1
