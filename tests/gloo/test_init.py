"""init against real processes on 127.0.0.1: fault scenarios A1-A8.

Each rank is a spawned process that runs a scripted list of init attempts and reports
what happened (outcome, elapsed time, missing ranks, the loop's worst lag) through a
pipe. Rank 0 hosts the store on a port the test picks, unless a row says otherwise.
Bounds keep a wide margin: the deadline plus 0.5 s + 10 % is the promised bound, and the
asserts allow several seconds more on this 2-core machine.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import anyio
import pytest
import torch
from netutil import free_port, rank_env

import agang

pytestmark = pytest.mark.gloo

_context = multiprocessing.get_context("spawn")
EPSILON = 3.0  # the promised 0.5 s + 10 %, widened for this machine


def _torchrun_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return rank_env(rank, port, world_size, agent_store=False)  # rank 0 hosts the store


async def _attempts(
    env: Mapping[str, str], timeouts: list[float], cancel_after: float | None
) -> list[dict[str, Any]]:
    reports = []
    for timeout in timeouts:
        lags: list[float] = []
        done = anyio.Event()

        async def ticker(lags: list[float] = lags, done: anyio.Event = done) -> None:
            while not done.is_set():
                before = time.monotonic()
                await anyio.sleep(0.01)
                lags.append(time.monotonic() - before - 0.01)

        report: dict[str, Any] = {}
        async with anyio.create_task_group() as group:
            group.start_soon(ticker)
            started = time.monotonic()
            try:
                with anyio.CancelScope() as scope:
                    if cancel_after is not None:
                        scope.deadline = anyio.current_time() + cancel_after
                    gang = await agang.init(env=env, timeout=timeout, in_process=False)
                    total = (await gang.all_reduce(torch.ones(1))).item()
                    await gang.close()
                    report = {"ok": total}
                if scope.cancelled_caught:
                    report = {"cancelled_in": time.monotonic() - started - (cancel_after or 0)}
            except agang.GangInitError as error:
                report = {
                    "error": str(error),
                    "missing": list(error.missing_ranks),
                    "attempts": error.attempts,
                }
            report["elapsed"] = time.monotonic() - started
            done.set()
        report["max_lag"] = max(lags, default=0.0)
        reports.append(report)
    return reports


def _rank(
    env: dict[str, str], timeouts: list[float], cancel_after: float | None, connection: Any
) -> None:
    try:
        connection.send(anyio.run(_attempts, env, timeouts, cancel_after))
    except BaseException as error:  # report, never hang the test
        connection.send([{"crash": repr(error)}])


class _Ranks:
    def __init__(self) -> None:
        self.processes: list[Any] = []
        self.pipes: list[Any] = []

    def start(
        self, env: dict[str, str], timeouts: list[float], cancel_after: float | None = None
    ) -> None:
        receiver, sender = _context.Pipe(duplex=False)
        process = _context.Process(
            target=_rank, args=(env, timeouts, cancel_after, sender), daemon=True
        )
        process.start()
        sender.close()
        self.processes.append(process)
        self.pipes.append(receiver)

    def reports(self, timeout: float) -> list[list[dict[str, Any]]]:
        deadline = time.monotonic() + timeout
        out = []
        for pipe in self.pipes:
            if not pipe.poll(max(0.0, deadline - time.monotonic())):
                raise AssertionError("a rank gave no report in time")
            out.append(pipe.recv())
        return out

    def first_report(self, among: list[int], timeout: float) -> tuple[int, list[dict[str, Any]]]:
        """The first report of the processes ``among`` (indexes), and whose it was; the
        others may still wait (``ranks`` kills them at its end)."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            for index in among:
                if self.pipes[index].poll(min(0.05, left)):
                    return index, self.pipes[index].recv()
        raise AssertionError("no rank gave a report in time")

    def exit_codes(self, timeout: float) -> list[int | None]:
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        return [process.exitcode for process in self.processes]


@contextmanager
def ranks() -> Iterator[_Ranks]:
    group = _Ranks()
    try:
        yield group
    finally:
        for process in group.processes:
            if process.is_alive():
                process.kill()
            process.join(5)


def test_a1_a_missing_rank_is_named_within_the_deadline_and_the_loop_keeps_running() -> None:
    port = free_port()
    with ranks() as group:
        for rank in (0, 1):
            group.start(_torchrun_env(rank, 3, port), [3.0])
        reports = [r[0] for r in group.reports(30)]

    for report in reports:
        assert report["missing"] == [2], report
        assert "127.0.0.1" in report["error"]
        assert report["elapsed"] < 3.0 + EPSILON
        assert report["max_lag"] < 0.3  # far below the 3 s a blocked loop would show


def test_a2_an_unreachable_store_is_named_within_the_deadline() -> None:
    port = free_port()
    with ranks() as group:
        group.start(_torchrun_env(1, 2, port), [2.0])  # rank 0, the store host, never starts
        report = group.reports(30)[0][0]

    assert f"127.0.0.1:{port}" in report["error"]
    assert report["elapsed"] < 2.0 + EPSILON
    assert report["attempts"] >= 1


def test_a3_a_store_that_starts_late_is_waited_for() -> None:
    port = free_port()
    with ranks() as group:
        group.start(_torchrun_env(1, 2, port), [30.0])
        time.sleep(1.5)
        group.start(_torchrun_env(0, 2, port), [30.0])
        reports = [r[0] for r in group.reports(60)]

    assert [r.get("ok") for r in reports] == [2.0, 2.0], reports


def test_a4_a_fixed_port_in_use_fails_fast_and_clearly() -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with ranks() as group:
            group.start(_torchrun_env(0, 2, port), [30.0])
            report = group.reports(30)[0][0]

    assert "in use" in report["error"]
    assert "`MASTER_PORT`" in report["error"]
    assert report["elapsed"] < 5.0  # fast: not retried until the 30 s deadline


def test_a4_a_derived_port_in_use_moves_to_a_free_one() -> None:
    # A SLURM job's port is derived from its id; take that port, then start the job.
    port = free_port(10000, 29990)
    job = {
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NODELIST": "127.0.0.1",
        "SLURM_JOB_ID": str(port - 10000),
        "SLURM_TASKS_PER_NODE": "2",
    }
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        with ranks() as group:
            for rank in (0, 1):
                group.start({**job, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)}, [30.0])
            reports = [r[0] for r in group.reports(60)]

    assert [r.get("ok") for r in reports] == [2.0, 2.0], reports


def test_a7_cancelling_init_is_prompt_and_leaves_nothing_behind() -> None:
    port = free_port()
    with ranks() as group:
        # Rank 1 never comes; rank 0 gives up waiting after 1 s of a 60 s deadline.
        group.start(_torchrun_env(0, 2, port), [60.0], cancel_after=1.0)
        report = group.reports(30)[0][0]
        exit_codes = group.exit_codes(10)

    assert report["cancelled_in"] < 0.5  # 50 ms is the aim; margin for this machine
    assert report["max_lag"] < 0.3
    assert exit_codes == [0]  # no thread kept the process from exiting


def test_a8_init_again_after_a_failure_succeeds() -> None:
    port = free_port()
    with ranks() as group:
        # Ranks 0 and 1 fail (rank 2 is missing), then try again; rank 2 comes late.
        for rank in (0, 1):
            group.start(_torchrun_env(rank, 3, port), [4.0, 60.0])
        time.sleep(7.0)
        group.start(_torchrun_env(2, 3, port), [60.0])
        reports = group.reports(90)

    # Rank 0 hosts the store, so it knows who never came; rank 1 may not have reached
    # the store in time at all. Both then succeed on their second init.
    assert reports[0][0].get("missing") == [2], reports
    assert "error" in reports[1][0]
    for _, second in reports[:2]:
        assert second.get("ok") == 3.0, reports
    assert reports[2][0].get("ok") == 3.0


def _cycles(env: dict[str, str], count: int, connection: Any) -> None:
    def census() -> dict[str, int]:
        # Init and close run on short-lived "agang: ..." threads that may be exiting
        # right after handing over their result: let them end before counting.
        for _ in range(200):
            if not any(t.name.startswith("agang: ") for t in threading.enumerate()):
                break
            time.sleep(0.01)
        fds = os.listdir("/proc/self/fd")
        sockets = sum(
            1
            for fd in fds
            if os.path.exists(f"/proc/self/fd/{fd}")
            and os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        )
        return {"fds": len(fds), "sockets": sockets, "threads": len(os.listdir("/proc/self/task"))}

    def sockets() -> list[str]:
        # What each open socket is (for the failure message): its TCP ends and state,
        # or its kind where it is not TCP.
        table: dict[str, str] = {}
        for name in ("tcp", "tcp6", "udp", "udp6", "unix"):
            with open(f"/proc/self/net/{name}") as lines:
                for line in list(lines)[1:]:
                    fields = line.split()
                    if name == "unix":
                        table[fields[6]] = f"unix {fields[7] if len(fields) > 7 else ''}"
                    else:
                        table[fields[9]] = f"{name} {fields[1]}->{fields[2]} st={fields[3]}"
        found = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inode = target[len("socket:[") : -1]
                found.append(table.get(inode, f"socket {inode}"))
        return sorted(found)

    def settled(baseline: dict[str, int]) -> dict[str, int]:
        # c10d closes the last gang's groups on its own native threads, which may
        # still be on their way out (CI once counted one socket over; a run beside two
        # busy loops counted 3 threads and 3 sockets over after 5 s, now that a Gloo
        # gang has a second group for its order checks): give them 10 s to finish,
        # threads too. A socket or thread leaked per cycle stays, and shows as +17.
        counted = census()
        for _ in range(100):
            if all(counted[key] <= baseline[key] for key in ("fds", "sockets", "threads")):
                break
            time.sleep(0.1)
            counted = census()
        return counted

    async def main() -> dict[str, Any]:
        before: dict[str, int] = {}
        sockets_before: list[str] = []
        for cycle in range(count):
            if cycle == 3:
                before = census()  # after warm-up: torch's own pools exist by now
                sockets_before = sockets()
            gang = await agang.init(env=env, timeout=60, in_process=False)
            await gang.all_reduce(torch.ones(1))
            await gang.close()
        after = settled(before)
        threads = sorted(t.name for t in threading.enumerate())
        return {
            "before": before,
            "after": after,
            "sockets": [sockets_before, sockets()],
            "threads": threads,
        }

    connection.send(anyio.run(main))


def test_a5_create_and_close_cycles_leak_nothing() -> None:
    port = free_port()
    # A leak per cycle would show as +17 (the 17 cycles after the count at cycle 3),
    # against a tolerance of 8 (of 6 for threads).
    count = 20
    pipes, processes = [], []
    try:
        for rank in (0, 1):
            receiver, sender = _context.Pipe(duplex=False)
            process = _context.Process(
                target=_cycles, args=(_torchrun_env(rank, 2, port), count, sender), daemon=True
            )
            process.start()
            pipes.append(receiver)
            processes.append(process)
        reports = []
        for pipe in pipes:
            assert pipe.poll(240), "a rank did not finish its cycles"
            reports.append(pipe.recv())
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(5)

    for report in reports:
        before, after = report["before"], report["after"]
        # A socket leaked per cycle would show as +17. CI once counted 6 sockets over
        # (of no thread: none was left) after the 5 s settle, on a busy machine: at most
        # one world's worth (store connections and Gloo pairs) may still be closing.
        one_world = 8
        assert after["fds"] <= before["fds"] + one_world, report
        assert after["sockets"] <= before["sockets"] + one_world, report
        # One leaked thread per cycle would show as +17 here. A loaded machine may still
        # be ending the last gang's native threads after the settle: at most one gang's
        # worth, 6 (3 for each of its two Gloo groups: the gang's and its order checks').
        assert after["threads"] <= before["threads"] + 6, report


def test_a_duplicate_rank_fails_at_once() -> None:
    port = free_port()
    with ranks() as group:
        group.start(_torchrun_env(0, 3, port), [8.0])
        for _ in range(2):  # two processes both claim rank 1
            group.start(_torchrun_env(1, 3, port), [8.0])
        # The duplicate fails at once; the others would wait out their 8 s deadline for
        # rank 2, which never comes, and are killed instead. Only one of the two is the
        # duplicate: the other, had it been told so too, would have within a moment.
        index, first = group.first_report([1, 2], 60)
        other = 3 - index
        told = group.pipes[other].recv() if group.pipes[other].poll(2.0) else None

    assert "must be unique" in first[0].get("error", ""), first
    assert first[0]["elapsed"] < 6.0  # at once, not at the 8 s deadline
    assert told is None or "must be unique" not in told[0].get("error", ""), told


def test_ranks_that_disagree_on_the_world_size_fail_at_once() -> None:
    port = free_port()
    with ranks() as group:
        group.start(_torchrun_env(0, 2, port), [30.0])
        group.start(_torchrun_env(1, 3, port), [8.0])  # believes in a world of 3
        host = group.first_report([0], 60)[1][0]  # rank 1 would wait out its 8 s

    assert "`WORLD_SIZE` must be the same on every rank" in host["error"], host
    assert host["elapsed"] < 15.0  # at once, not at the 30 s deadline


def test_a9_check_order_set_on_some_ranks_only_fails_at_once_naming_it() -> None:
    # Rank 0 checks order (Gloo's default: it would make the side group), rank 1 turned
    # it off: once both checked in they fail, naming the setting, not at the 30 s
    # deadline with hints about ranks that never started.
    port = free_port()
    with ranks() as group:
        group.start(_torchrun_env(0, 2, port), [30.0])
        group.start({**_torchrun_env(1, 2, port), "AGANG_CHECK_ORDER": "0"}, [30.0])
        reports = [r[0] for r in group.reports(60)]

    for rank, report in enumerate(reports):
        assert "`check_order` must be the same on every rank" in report["error"], report
        other = 1 - rank
        assert f"on rank {other} (" in report["error"], report
        assert report["elapsed"] < 10.0, report  # the deadline was 30 s
    assert "is True here (rank 0) and False on rank 1" in reports[0]["error"]
