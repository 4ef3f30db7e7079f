"""The self-check's checks: what agang promises on NCCL, each measured on a harness.

Every check runs on every local rank's gang at once, makes the last rank's device late
where it needs a late peer (``Harness.stall``), and returns its result with a figure.
A check that needs a late device waits until that device has caught up before the next
check starts. Bounds leave wide margins: a pass is milliseconds where a failure is the
whole stall.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio
import torch

from agang._cli.selfcheck.harness import Harness, StallEnd
from agang._cli.selfcheck.report import Result, Row
from agang._errors import GangError, GangTimeoutError
from agang._gang import Gang
from agang._gradient_sync import GradientSync

T = TypeVar("T")
Check = Callable[[Harness], Awaitable[tuple[Result, str]]]

CHECK_SECONDS = 60.0  # no check may take longer


async def each(gangs: Sequence[Gang], fn: Callable[[int, Gang], Awaitable[T]]) -> list[T]:
    """Runs ``fn`` for every local gang at once (ranks of one process wait for each other)."""
    results: dict[int, T] = {}

    async def one(index: int, gang: Gang) -> None:
        results[index] = await fn(index, gang)

    async with anyio.create_task_group() as tasks:
        for index, gang in enumerate(gangs):
            tasks.start_soon(one, index, gang)
    return [results[i] for i in range(len(gangs))]


def _expected_sum(h: Harness) -> float:
    return h.size * (h.size + 1) / 2  # rank r contributes r + 1


def _rank_tensors(gangs: Sequence[Gang], numel: int = 4) -> list[torch.Tensor]:
    return [torch.full((numel,), float(g.rank + 1), device=g.device) for g in gangs]


async def _is_broken(gang: Gang) -> bool:
    try:
        await gang.all_reduce(torch.ones(1, device=gang.device))
    except GangError:
        return True
    return False


async def _close_past_stall(gangs: list[Gang], stall_end: StallEnd) -> tuple[float, str]:
    """Closes ``gangs``; returns close's own time and a note on what it waited for.

    On NCCL, aborting a communicator waits until this rank's device has reached the
    communicator's queued kernels (measured on an H100: a pending all-reduce queued
    behind 1.8 s of the rank's own kernel made ``abort()`` take 1.46 s). A rank whose
    own device is stalled therefore closes once its device got past the stall, which no
    abort can shorten; close's own time is counted from then. Ranks that wait for a
    late peer count from close's start.
    """
    ended: list[float | None] = []

    async def watch() -> None:
        ended.append(await anyio.to_thread.run_sync(stall_end))

    async with anyio.create_task_group() as group:
        group.start_soon(watch)
        closing = time.monotonic()
        await each(gangs, lambda i, g: g.close())
        closed = time.monotonic()
    end = ended[0] if ended else None
    if end is None or not closing < end < closed:
        return closed - closing, ""  # no stall here, or close did not wait for it
    return (
        closed - end,
        f" after this rank's own stalled device got past it ({end - closing:.2f} s)",
    )


async def completion(h: Harness) -> tuple[Result, str]:
    """``await`` returns once the op ran on the device; what one small op costs."""
    gangs = await h.gangs("selfcheck-completion")
    tensors = _rank_tensors(gangs)
    h.stall(0.3)
    marks = [h.mark(g) for g in gangs]  # behind the stall on the last rank
    await each(gangs, lambda i, g: g.all_reduce(tensors[i]))
    ran = all(m.query() for m in marks)
    correct = all(bool(t.eq(_expected_sum(h)).all()) for t in tensors)
    small = [torch.ones(4, device=g.device) for g in gangs]
    num_ops = 200
    started = time.perf_counter()
    for _ in range(num_ops):
        await each(gangs, lambda i, g: g.all_reduce(small[i]))
    cost = (time.perf_counter() - started) / num_ops * 1e6
    figure = (
        f"{'await returned after the device ran the op' if ran else 'await returned early'}"
        f"{'' if correct else ', WRONG RESULT'}; {cost:.0f} us per 4-element all_reduce "
        f"({num_ops} ops, {len(gangs)} local rank(s))"
    )
    return ("PASS" if ran and correct else "FAIL"), figure


async def max_loop_lag(work: Callable[[], Awaitable[Any]]) -> tuple[float, Any]:
    """Runs ``work()`` while a ticker measures how late the loop ran it; returns the
    largest lag and ``work``'s result."""
    lag = 0.0
    finished = anyio.Event()
    result: list[Any] = []

    async def ticker() -> None:
        nonlocal lag
        while not finished.is_set():
            before = time.perf_counter()
            await anyio.sleep(0.01)
            lag = max(lag, time.perf_counter() - before - 0.01)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(ticker)
        try:
            result.append(await work())
        finally:
            finished.set()
    return lag, result[0]


async def barrier(h: Harness) -> tuple[Result, str]:
    """A barrier never blocks the event loop, even while a peer is late."""
    gangs = await h.gangs("selfcheck-barrier")
    late = 2.0
    h.stall(late)
    started = time.monotonic()
    lag, _ = await max_loop_lag(lambda: each(gangs, lambda i, g: g.barrier()))
    took = time.monotonic() - started
    figure = (
        f"loop lag at most {lag * 1e3:.0f} ms in a {took:.1f} s barrier (a peer {late:.0f} s late)"
    )
    return ("PASS" if lag < 0.5 else "FAIL"), figure


async def timeout_then_abort(h: Harness) -> tuple[Result, str]:
    """An op past its deadline fails with GangTimeoutError on time, the gang is broken
    (its communicator aborted), and close is quick."""
    gangs = await h.gangs("selfcheck-timeout")
    tensors = _rank_tensors(gangs)
    deadline = 0.5
    stall_end = h.stall(3.0)
    started = time.monotonic()

    async def expect_timeout(i: int, g: Gang) -> float:
        try:
            await g.all_reduce(tensors[i], timeout=deadline)
        except GangTimeoutError:
            return time.monotonic() - started
        return -1.0

    failed_after = await each(gangs, expect_timeout)
    broken = await each(gangs, lambda i, g: _is_broken(g))
    close_took, waited = await _close_past_stall(gangs, stall_end)
    on_time = all(0 < t < deadline + 2.5 for t in failed_after)
    ok = on_time and all(broken) and close_took < 1.0
    figure = (
        f"GangTimeoutError after {max(failed_after):.2f} s (deadline {deadline} s); "
        f"gang broken: {all(broken)}; close {close_took * 1e3:.0f} ms{waited}"
    )
    return ("PASS" if ok else "FAIL"), figure


async def close_with_hung_op(h: Harness) -> tuple[Result, str]:
    """Closing a gang whose op waits for a late peer returns at once and fails the op."""
    gangs = await h.gangs("selfcheck-close")
    tensors = _rank_tensors(gangs)
    stall_end = h.stall(2.0)
    handles = [g.all_reduce(t) for g, t in zip(gangs, tensors, strict=True)]
    await anyio.sleep(0.2)
    took, waited = await _close_past_stall(gangs, stall_end)
    outcomes = []
    for handle in handles:
        try:
            await handle
            outcomes.append("finished")
        except GangError:
            outcomes.append("failed")
    # An op that the device finished before the close may still succeed; none may hang.
    figure = f"close took {took * 1e3:.0f} ms{waited}; the ops: {', '.join(outcomes)}"
    return ("PASS" if took < 1.0 else "FAIL"), figure


async def stream_ordered(h: Harness) -> tuple[Result, str]:
    """Stream-ordered mode: ``await`` returns once ordered, results are right once the
    stream got there, and a deadline still breaks the gang."""
    gangs = await h.gangs("selfcheck-ordered", stream_ordered=True)
    tensors = _rank_tensors(gangs)
    h.stall(2.0)
    started = time.monotonic()
    await each(gangs, lambda i, g: g.all_reduce(tensors[i]))
    ordered_in = time.monotonic() - started
    await h.settle()
    correct = all(bool(t.eq(_expected_sum(h)).all()) for t in tensors)
    h.stall(2.0)
    await each(gangs, lambda i, g: g.all_reduce(tensors[i], timeout=0.5))
    await anyio.sleep(1.2)  # past the deadline, before the device caught up
    broken = await each(gangs, lambda i, g: _is_broken(g))
    await each(gangs, lambda i, g: g.close())
    ok = ordered_in < 0.5 and correct and all(broken)
    figure = (
        f"ordered in {ordered_in * 1e3:.0f} ms with a peer 2 s late; result "
        f"{'right' if correct else 'WRONG'} after the stream got there; deadline broke the "
        f"gang: {all(broken)}"
    )
    return ("PASS" if ok else "FAIL"), figure


async def separate_gangs(h: Harness) -> tuple[Result, str]:
    """Gang B's op finishes while gang A's op waits for a late peer (own side stream and
    watcher per gang: no head-of-line blocking across gangs or lanes)."""
    a = await h.gangs("selfcheck-gang-a")
    b = await h.gangs("selfcheck-gang-b")
    last = h.size - 1
    took: list[float] = []

    async def program(i: int, gang_a: Gang) -> None:
        gang_b = b[i]
        one_a, one_b = torch.ones(4, device=gang_a.device), torch.ones(4, device=gang_b.device)
        started = time.monotonic()
        if gang_a.rank != last:
            pending = gang_a.all_reduce(one_a)  # the last rank issues it only after B's op
            with anyio.fail_after(10.0):
                await gang_b.all_reduce(one_b)
            took.append(time.monotonic() - started)
            await pending
        else:
            await gang_b.all_reduce(one_b)
            await gang_a.all_reduce(one_a)

    await each(a, program)
    for gang in [*a, *b]:
        await gang.close()
    if h.size < 2:
        return "PASS", "one rank: no peer to wait for (run with 2+ ranks to exercise this)"
    return "PASS", f"gang B's op finished in {max(took) * 1e3:.0f} ms while gang A's waited"


async def gradient_sync(h: Harness) -> tuple[Result, str]:
    """GradientSync gives the gradients the reference gives (DDP on GPUs)."""
    gangs = await h.gangs("selfcheck-gradsync")
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    models = [copy.deepcopy(base).to(g.device) for g in gangs]
    references = [copy.deepcopy(m) for m in models]
    inputs = []
    for g in gangs:
        generator = torch.Generator().manual_seed(1000 + g.rank)
        inputs.append(torch.randn(16, 32, generator=generator).to(g.device))
    syncs = [
        GradientSync(m, g, first_bucket_bytes=4096) for m, g in zip(models, gangs, strict=True)
    ]
    await each(gangs, lambda i, g: syncs[i].ready())
    for model, x in zip(models, inputs, strict=True):
        model(x).square().mean().backward()
    await each(gangs, lambda i, g: syncs[i].wait())
    await h.settle()
    expected = h.reference_gradients(references, inputs)
    actual = [torch.cat([p.grad.reshape(-1) for p in m.parameters()]) for m in models]  # type: ignore[union-attr]
    difference = max(float((a - e).abs().max()) for a, e in zip(actual, expected, strict=True))
    for gang in gangs:
        await gang.close()
    figure = (
        f"max |difference| {difference:.1e} over {actual[0].numel()} gradients, "
        f"{syncs[0].num_buckets} buckets"
    )
    return ("PASS" if difference < 1e-5 else "FAIL"), figure


async def devices(h: Harness) -> tuple[Result, str]:
    """agang's threads bound the gang's device before touching it (no stray contexts)."""
    ok, figure = h.device_binding()
    return ("PASS" if ok else "FAIL"), figure


async def private_streams(h: Harness) -> tuple[Result, str]:
    """Each gang's side stream is its own, never one torch's stream pool hands out."""
    gangs = await h.gangs("selfcheck-streams")
    await each(gangs, lambda i, g: g.all_reduce(torch.ones(1, device=g.device)))
    seen = h.stream_privacy(gangs[0])
    for gang in gangs:
        await gang.close()
    if seen is None:
        return "SKIP", "simulated streams are never pooled"
    ok, figure = seen
    return ("PASS" if ok else "FAIL"), figure


CHECKS: list[tuple[str, Check]] = [
    ("completion", completion),
    ("barrier", barrier),
    ("timeout_then_abort", timeout_then_abort),
    ("close", close_with_hung_op),
    ("stream_ordered", stream_ordered),
    ("separate_gangs", separate_gangs),
    ("gradient_sync", gradient_sync),
    ("devices", devices),
    ("private_streams", private_streams),
]


async def run_checks(h: Harness, checks: Sequence[tuple[str, Check]] = CHECKS) -> list[Row]:
    """Runs ``checks`` in order; a check that raises or overruns is a FAIL."""
    rows = []
    for name, check in checks:
        try:
            with anyio.fail_after(CHECK_SECONDS):
                result, figure = await check(h)
        except TimeoutError:
            result, figure = "FAIL", f"did not finish within {CHECK_SECONDS:.0f} s"
        except Exception as exc:
            result, figure = "FAIL", f"{type(exc).__name__}: {exc}"
        rows.append(Row(name, result, figure))
        with anyio.move_on_after(CHECK_SECONDS):
            await h.settle()  # a stalled device catches up before the next check
    return rows
