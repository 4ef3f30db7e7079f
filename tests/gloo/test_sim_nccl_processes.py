"""The simulated NCCL across processes, on raw c10d groups of the ``agang_sim_nccl``
backend: each rank a process with its simulated device, their ops meeting over the wire.

Each kernel's result is the one every rank computes from the same inputs with the same
reduction (``reduce_tensors``, in rank order), bit for bit, as the in-process
simulation's; a killed peer leaves the survivors' op pending until they abort, as NCCL's
kernels wait for a peer that never comes; the watchdog fails what outlives its timeout;
a transfer whose sizes disagree fails on both ranks, and both live on.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from agang._backends.sim_nccl.c10d_group import SIM_NCCL_BACKEND
from agang._backends.sim_nccl.process import ProcessSimulation
from agang._backends.sim_nccl.reduce import reduce_tensors
from agang._reduce_op import ReduceOp
from agang.testing import WorldRunError, run_world, use_simulated_nccl

pytestmark = pytest.mark.gloo

RUN_TIMEOUT = 90.0


def _world(watchdog_timeout: float | None = None) -> dist.ProcessGroup:
    ProcessSimulation.install(watchdog_timeout=watchdog_timeout)
    dist.init_process_group(SIM_NCCL_BACKEND, timeout=timedelta(seconds=60))
    return dist.group.WORLD  # type: ignore[return-value]


def _wait(work: Any, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(f"an op did not complete in {seconds} s")
        time.sleep(0.001)
    if work.exception() is not None:
        raise work.exception()


def _input(rank: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + rank)
    values = torch.randn(shape, generator=generator) * 100
    return values.to(dtype)


def _every_kernel() -> dict[str, bool]:
    group = _world()
    rank, size = group.rank(), group.size()
    checks: dict[str, bool] = {}
    try:
        for name, op, dtype in [
            ("allreduce sum f32", ReduceOp.SUM, torch.float32),
            ("allreduce max i64", ReduceOp.MAX, torch.int64),
            ("allreduce sum bf16", ReduceOp.SUM, torch.bfloat16),
        ]:
            tensor = _input(rank, (5, 3), dtype)
            options = dist.AllreduceOptions()
            c10d_op = dist.ReduceOp.SUM if op is ReduceOp.SUM else dist.ReduceOp.MAX
            options.reduceOp = c10d_op  # type: ignore[assignment]
            _wait(group.allreduce([tensor], options))
            expected = reduce_tensors([_input(r, (5, 3), dtype) for r in range(size)], op)
            checks[name] = torch.equal(tensor, expected)
        avg = dist.AllreduceOptions()
        avg.reduceOp = dist.ReduceOp.AVG  # type: ignore[assignment]
        tensor = _input(rank, (7,))
        _wait(group.allreduce([tensor], avg))
        expected = reduce_tensors([_input(r, (7,)) for r in range(size)], ReduceOp.MEAN)
        checks["allreduce avg"] = torch.equal(tensor, expected)

        tensor = _input(rank, (4,))
        options = dist.BroadcastOptions()
        options.rootRank = 1
        _wait(group.broadcast([tensor], options))
        checks["broadcast"] = torch.equal(tensor, _input(1, (4,)))

        outputs = [torch.empty(3) for _ in range(size)]
        _wait(group.allgather([outputs], [_input(rank, (3,))]))
        checks["allgather"] = all(torch.equal(o, _input(r, (3,))) for r, o in enumerate(outputs))

        flat = torch.empty(size * 2, 2)
        _wait(group._allgather_base(flat, _input(rank, (2, 2))))
        checks["all_gather_single"] = torch.equal(
            flat, torch.cat([_input(r, (2, 2)) for r in range(size)])
        )

        chunk = torch.empty(2)
        scatter_options = dist.ReduceScatterOptions()
        _wait(group._reduce_scatter_base(chunk, _input(rank, (2 * size,)), scatter_options))
        total = reduce_tensors([_input(r, (2 * size,)) for r in range(size)], ReduceOp.SUM)
        checks["reduce_scatter_single"] = torch.equal(chunk, total[2 * rank : 2 * rank + 2])

        # Uneven blocks: rank r sends r + j + 1 rows to rank j.
        sends = [rank + j + 1 for j in range(size)]
        receives = [j + rank + 1 for j in range(size)]
        source = torch.arange(sum(sends) * 2, dtype=torch.float32).reshape(-1, 2) + 100 * rank
        received = torch.empty(sum(receives), 2)
        _wait(group.alltoall_base(received, source, receives, sends, dist.AllToAllOptions()))
        blocks = []
        for j in range(size):
            theirs = torch.arange(sum(j + k + 1 for k in range(size)) * 2, dtype=torch.float32)
            theirs = theirs.reshape(-1, 2) + 100 * j
            start = sum(j + k + 1 for k in range(rank))
            blocks.append(theirs[start : start + j + rank + 1])
        checks["all_to_all_single uneven"] = torch.equal(received, torch.cat(blocks))

        tensor = _input(rank, (3,))
        reduce_options = dist.ReduceOptions()
        reduce_options.rootRank = 2
        _wait(group.reduce([tensor], reduce_options))
        if rank == 2:
            expected = reduce_tensors([_input(r, (3,)) for r in range(size)], ReduceOp.SUM)
            checks["reduce"] = torch.equal(tensor, expected)

        gather_options = dist.GatherOptions()
        gather_options.rootRank = 0
        gathered = [torch.empty(2) for _ in range(size)] if rank == 0 else []
        _wait(group.gather([gathered] if rank == 0 else [], [_input(rank, (2,))], gather_options))
        if rank == 0:
            checks["gather"] = all(torch.equal(g, _input(r, (2,))) for r, g in enumerate(gathered))

        scatter_to = dist.ScatterOptions()
        scatter_to.rootRank = 1
        mine = torch.empty(2)
        pieces = [_input(10 + r, (2,)) for r in range(size)]
        _wait(group.scatter([mine], [pieces] if rank == 1 else [], scatter_to))
        checks["scatter"] = torch.equal(mine, _input(10 + rank, (2,)))

        # A ring of transfers in one coalescing group: each pair waits on its own.
        received = torch.empty(3)
        group._start_coalescing(torch.device("cpu"))
        group.send([_input(rank, (3,))], (rank + 1) % size, 0)
        group.recv([received], (rank - 1) % size, 0)
        _wait(group._end_coalescing(torch.device("cpu")))
        checks["coalesced ring"] = torch.equal(received, _input((rank - 1) % size, (3,)))

        # Lone transfers on the communicator's stream, in matching order.
        if rank == 0:
            _wait(group.send([torch.arange(4.0)], 1, 0))
        elif rank == 1:
            alone = torch.zeros(4)
            _wait(group.recv([alone], 0, 0))
            checks["send and recv"] = torch.equal(alone, torch.arange(4.0))

        group.barrier().wait()  # blocks, as NCCL's barrier does
        checks["barrier"] = True
    finally:
        dist.destroy_process_group()
    return checks


def test_every_kernel_equals_the_reduction_of_every_rank_s_inputs_bit_for_bit() -> None:
    results = run_world(_every_kernel, 3, make_gang=False, timeout=RUN_TIMEOUT)
    for rank, checks in enumerate(results):
        assert checks, rank
        assert all(checks.values()), (rank, checks)
    assert "reduce" in results[2]
    assert "gather" in results[0]
    assert "send and recv" in results[1]


def _killed_peer() -> dict[str, Any]:
    group = _world()
    rank = group.rank()
    _wait(group.allreduce([torch.ones(2)]))
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)  # the peer is gone
    work = group.allreduce([torch.ones(2)])
    time.sleep(1.5)
    pending = not work.is_completed()
    started = time.monotonic()
    group.abort()
    aborted_in = time.monotonic() - started
    error = work.exception()
    return {
        "pending before abort": pending,
        "completed after abort": work.is_completed(),
        "error": repr(error),
        "abort seconds": aborted_in,
    }


def test_a_killed_peer_leaves_the_survivors_ops_pending_until_they_abort() -> None:
    with pytest.raises(WorldRunError) as caught:
        run_world(_killed_peer, 3, make_gang=False, timeout=RUN_TIMEOUT)
    assert set(caught.value.failures) == {2}, caught.value.failures
    for rank in (0, 1):
        seen = caught.value.results[rank]
        assert seen["pending before abort"], seen
        assert seen["completed after abort"], seen
        assert "aborted" in seen["error"], seen
        assert seen["abort seconds"] < 5.0, seen  # 10-35 ms to close the wire


def _watchdog() -> dict[str, Any]:
    group = _world(watchdog_timeout=1.0)
    if group.rank() == 1:
        time.sleep(4.0)  # never joins
        return {}
    work = group.allreduce([torch.ones(2)])
    started = time.monotonic()
    while not work.is_completed() and time.monotonic() - started < 30:
        time.sleep(0.01)
    return {
        "seconds": time.monotonic() - started,
        "error": repr(work.exception()),
        "state": group.get_error(),  # type: ignore[attr-defined]
    }


def test_the_watchdog_fails_an_op_that_outlives_its_timeout() -> None:
    seen = run_world(_watchdog, 2, make_gang=False, timeout=RUN_TIMEOUT)[0]
    assert "Watchdog caught collective operation timeout" in seen["error"], seen
    assert seen["state"] == "TIMEOUT", seen
    assert 0.9 < seen["seconds"] < 10.0, seen


def _mismatched_sizes() -> dict[str, Any]:
    group = _world()
    rank = group.rank()
    work = group.send([torch.ones(4)], 1, 0) if rank == 0 else group.recv([torch.zeros(3)], 0, 0)
    deadline = time.monotonic() + 30
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.001)
    error = repr(work.exception())
    after = torch.ones(1)
    _wait(group.allreduce([after]))  # the communicator still works
    dist.destroy_process_group()
    lanes = _wire_threads_after(5.0)
    return {"error": error, "after": after.item(), "wire threads": lanes}


def _wire_threads_after(seconds: float) -> list[str]:
    deadline = time.monotonic() + seconds
    while True:
        alive = [t.name for t in threading.enumerate() if t.name.startswith("agang-sim-nccl-wire")]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.01)


def test_a_transfer_whose_sizes_disagree_fails_on_both_ranks_and_both_live_on() -> None:
    results = run_world(_mismatched_sizes, 2, make_gang=False, timeout=RUN_TIMEOUT)
    for seen in results:
        assert "rank 0 sent 16 bytes to rank 1, which receives 12 bytes" in seen["error"], seen
        assert seen["after"] == 2.0, seen
        assert seen["wire threads"] == [], seen  # destroy closed the wire


def _raw_torch_program() -> list[float]:
    """A user's program on torch.distributed alone, with the public switch."""
    dist.init_process_group(use_simulated_nccl())
    tensor = torch.full((2,), float(dist.get_rank() + 1))
    work = dist.all_reduce(tensor, async_op=True)
    assert work is not None
    _wait(work)
    dist.destroy_process_group()
    return tensor.tolist()


def test_a_raw_torch_program_runs_on_the_public_switch() -> None:
    assert run_world(_raw_torch_program, 2, make_gang=False, timeout=RUN_TIMEOUT) == [
        [3.0, 3.0],
        [3.0, 3.0],
    ]


@pytest.mark.parametrize(
    ("value", "error"), [(-1.0, ValueError), ("10", TypeError), (True, TypeError)]
)
def test_the_switch_refuses_a_bad_watchdog_timeout_naming_it(value: Any, error: type) -> None:
    with pytest.raises(error, match="`watchdog_timeout` must be"):
        use_simulated_nccl(watchdog_timeout=value)


def _unreadable_input() -> dict[str, Any]:
    group = _world()
    rank = group.rank()
    # Rank 0's input cannot be read as bytes (a sparse tensor): the op fails on both
    # ranks alike, and the next op still meets (the wire stays in step).
    tensor = torch.ones(2).to_sparse() if rank == 0 else torch.ones(2)
    work = group.allreduce([tensor])
    deadline = time.monotonic() + 30
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.001)
    after = torch.ones(1)
    _wait(group.allreduce([after]))
    dist.destroy_process_group()
    return {"error": repr(work.exception()), "after": after.item()}


def test_an_input_that_cannot_be_read_fails_the_op_on_every_rank_and_the_next_meets() -> None:
    results = run_world(_unreadable_input, 2, make_gang=False, timeout=RUN_TIMEOUT)
    for seen in results:
        assert "rank 0's inputs could not be read" in seen["error"], seen
        assert seen["after"] == 2.0, seen
