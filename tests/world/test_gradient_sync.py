"""GradientSync on FakeWorld (replicas with different data) and against DDP on Gloo.

The reference for FakeWorld is the plain average of the ranks' gradients; on Gloo, the
trainer example runs with ``--check-ddp`` on 2 ranks, which compares every step's loss
and the final parameters with torch's DistributedDataParallel, and 3 ranks compare
their gradients with DDP's bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import agang
from agang._gradient_sync import DEFAULT_BUCKET_BYTES
from agang.testing import FakeWorld, run_world

ROOT = Path(__file__).resolve().parents[2]


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 10), torch.nn.Linear(10, 3)
    )


def data(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * rank + step))


def local_gradients(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    model(x).pow(2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    return grads


def gradient_values(module: torch.nn.Module) -> list[float]:
    return [v for p in module.parameters() for v in p.grad.flatten().tolist()]  # type: ignore[union-attr]


@pytest.mark.anyio
@pytest.mark.parametrize("bucket_bytes", [64, 400, 10**6])
async def test_gradients_are_the_average_over_ranks(bucket_bytes: int) -> None:
    world = FakeWorld(3)
    reference = make_model(seed=0)  # rank 0's start, which every replica receives
    expected = [
        sum(g) / 3
        for g in zip(*(local_gradients(reference, data(r, 0)) for r in range(3)), strict=True)
    ]

    async def program(gang: agang.Gang) -> tuple[list[torch.Tensor], int]:
        model = make_model(seed=gang.rank)  # replicas start apart
        sync = agang.GradientSync(model, gang, bucket_bytes=bucket_bytes)
        await sync.ready()
        model(data(gang.rank, 0)).pow(2).sum().backward()
        await sync.wait()
        return [p.grad.clone() for p in model.parameters()], sync.num_buckets  # type: ignore[union-attr]

    results = await world.run(program)
    for grads, num_buckets in results:
        # DDP's buckets: closed once they hold at least the limit (tensors of 12, 120,
        # 40, 400, 40 and 240 bytes in backward order).
        assert num_buckets == {64: 3, 400: 2, 10**6: 1}[bucket_bytes]
        for got, want in zip(grads, expected, strict=True):
            torch.testing.assert_close(got, want)


@pytest.mark.anyio
async def test_no_sync_accumulates_then_reduces_the_sum() -> None:
    world = FakeWorld(2)
    reference = make_model()
    per_rank = [
        [
            a + b
            for a, b in zip(
                local_gradients(reference, data(r, 0)),
                local_gradients(reference, data(r, 1)),
                strict=True,
            )
        ]
        for r in range(2)
    ]
    expected = [(a + b) / 2 for a, b in zip(*per_rank, strict=True)]

    async def program(gang: agang.Gang) -> tuple[list[torch.Tensor], int]:
        model = make_model()
        sync = agang.GradientSync(model, gang)
        await sync.ready()
        with sync.no_sync():
            model(data(gang.rank, 0)).pow(2).sum().backward()
        issued = gang.statistics().num_issued
        model(data(gang.rank, 1)).pow(2).sum().backward()
        await sync.wait()
        return [p.grad.clone() for p in model.parameters()], issued  # type: ignore[union-attr]

    for grads, issued_inside in await world.run(program):
        assert issued_inside == 1  # the start-up broadcast only
        for got, want in zip(grads, expected, strict=True):
            torch.testing.assert_close(got, want)


@pytest.mark.anyio
@pytest.mark.parametrize("set_to_none", [True, False])
async def test_a_no_sync_gradient_is_reduced_when_the_synchronised_step_skips_it(
    set_to_none: bool,
) -> None:
    # `late` is used only in the no_sync micro-batches. As with DDP's
    # find_unused_parameters=True, the synchronised step all-reduces the sum they left,
    # whether it sits in a fresh tensor (`.grad` was None) or in the bucket's view.
    world = FakeWorld(2)

    async def program(gang: agang.Gang) -> list[list[float]]:
        torch.manual_seed(0)
        early, late = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
        model = torch.nn.ModuleList([early, late])
        sync = agang.GradientSync(model, gang)
        await sync.ready()
        x = torch.full((1, 2), float(gang.rank + 1))
        seen = []
        for _ in range(2):  # `.grad` None at first, then per `set_to_none`
            with sync.no_sync():
                for _ in range(2):
                    late(x).sum().backward()
            early(torch.ones(1, 2)).sum().backward()
            await sync.wait()
            seen += [gradient_values(late), gradient_values(early)]
            model.zero_grad(set_to_none=set_to_none)
        # No gradient at all since the last synchronised step: zeros, nothing stale.
        early(torch.ones(1, 2)).sum().backward()
        await sync.wait()
        seen.append(gradient_values(late))
        return seen

    # Rank r's two micro-batches give `late` 2 * (r + 1) per weight and 2 for the bias.
    step = [[3.0, 3.0, 2.0], [1.0, 1.0, 1.0]]
    assert await world.run(program) == [[*step, *step, [0.0, 0.0, 0.0]]] * 2


@pytest.mark.anyio
async def test_a_parameter_used_on_one_rank_only_is_averaged_with_zeros() -> None:
    world = FakeWorld(2)

    async def program(gang: agang.Gang) -> list[float]:
        torch.manual_seed(0)
        used, spare = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
        model = torch.nn.ModuleList([used, spare])
        sync = agang.GradientSync(model, gang)
        await sync.ready()
        out = used(torch.ones(1, 2)).sum()
        if gang.rank == 1:
            out = out + spare(torch.ones(1, 2)).sum()
        out.backward()
        await sync.wait()
        return [spare.bias.grad.item(), used.bias.grad.item()]  # type: ignore[union-attr]

    assert await world.run(program) == [[0.5, 1.0], [0.5, 1.0]]


@pytest.mark.anyio
@pytest.mark.parametrize("bucket_bytes", [12, DEFAULT_BUCKET_BYTES])
async def test_an_op_between_backward_and_wait_pairs_with_itself_when_a_rank_skips_a_parameter(
    bucket_bytes: int,
) -> None:
    """Rank 0 never uses `expert` (no token reached it); both ranks all-reduce a loss
    metric between backward and wait. Every bucket is issued by backward's end, so the
    metric pairs with the metric, not with a gradient bucket."""
    world = FakeWorld(2)

    async def program(gang: agang.Gang) -> tuple[float, list[float]]:
        torch.manual_seed(0)
        shared, expert = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        model = torch.nn.ModuleList([shared, expert])
        sync = agang.GradientSync(model, gang, bucket_bytes=bucket_bytes)
        await sync.ready()
        hidden = shared(torch.ones(1, 2))
        if gang.rank == 1:
            hidden = expert(hidden)
        loss = hidden.sum()
        loss.backward()
        metric = await gang.all_reduce(torch.full((1,), 100.0 * (gang.rank + 1)))
        await sync.wait()
        return metric.item(), [shared.bias.grad.sum().item(), expert.bias.grad.sum().item()]  # type: ignore[union-attr]

    torch.manual_seed(0)
    shared, expert = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    shared(torch.ones(1, 2)).sum().backward()
    expert(shared(torch.ones(1, 2))).sum().backward()
    expected = [shared.bias.grad.sum().item() / 2, expert.bias.grad.sum().item() / 2]  # type: ignore[union-attr]
    for metric, grads in await world.run(program):
        assert metric == 300.0
        assert grads == pytest.approx(expected)


@pytest.mark.anyio
async def test_reentrant_checkpointing_in_two_segments_is_refused_clearly() -> None:
    """A reentrant checkpoint runs a backward inside the backward; with two segments the
    first one's end is taken for the step's (rule 4), and the second's gradients come
    after every bucket was issued: a clear error, never a wrong gradient."""
    gang = agang.FakeGang(size=1)
    torch.manual_seed(0)
    first, second = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
    sync = agang.GradientSync(torch.nn.ModuleList([first, second]), gang)
    await sync.ready()
    x = torch.ones(1, 3, requires_grad=True)
    out = checkpoint(second, checkpoint(first, x, use_reentrant=True), use_reentrant=True)
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        out.sum().backward()
    sync.remove()


@pytest.mark.anyio
async def test_buckets_are_issued_in_index_order_whatever_the_hook_order() -> None:
    world = FakeWorld(2)

    async def program(gang: agang.Gang) -> list[int]:
        torch.manual_seed(0)
        first, second = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
        model = torch.nn.ModuleList([first, second])
        # Each tensor (12 or 36 bytes) reaches a 12-byte limit: one bucket per tensor.
        sync = agang.GradientSync(model, gang, bucket_bytes=12)
        await sync.ready()
        # One backward, whose hooks fire outer layer first: rank 0 gets `second`'s
        # gradients before `first`'s, rank 1 the reverse.
        inner, outer = (first, second) if gang.rank == 0 else (second, first)
        outer(inner(torch.ones(1, 3))).sum().backward()
        await sync.wait()
        last = sync.last_step()
        assert last is not None
        issued = sorted(last.buckets, key=lambda bucket: bucket.issued_at)
        return [bucket.index for bucket in issued]

    assert await world.run(program) == [[0, 1, 2, 3], [0, 1, 2, 3]]


@pytest.mark.anyio
async def test_misuse_raises_clear_errors() -> None:
    gang = agang.FakeGang(size=2)
    model = make_model()
    with pytest.raises(TypeError, match=r"`model` must be a torch\.nn\.Module"):
        agang.GradientSync("model", gang)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"`gang` must be an agang\.Gang"):
        agang.GradientSync(model, "gang")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`bucket_bytes`"):
        agang.GradientSync(model, gang, bucket_bytes=0)
    with pytest.raises(ValueError, match="`source_rank`"):
        agang.GradientSync(model, gang, source_rank=5)

    sync = agang.GradientSync(model, gang)
    await sync.ready()
    model(torch.ones(1, 6)).sum().backward()
    with pytest.raises(RuntimeError, match="second gradient before"):
        model(torch.ones(1, 6)).sum().backward()
    sync.remove()


def test_a_sparse_gradient_is_refused_by_name() -> None:
    world = FakeWorld(1)
    model = torch.nn.Embedding(5, 2, sparse=True)
    sync = agang.GradientSync(model, world[0])
    sync.ready_sync(timeout=30)

    with pytest.raises(TypeError, match=r"dense gradients only.*shape \(5, 2\).*sparse_coo"):
        model(torch.tensor([1, 3])).sum().backward()
    world[0].close_sync()


def test_a_forward_pass_before_the_broadcast_raises() -> None:
    world = FakeWorld(2)
    model = make_model()
    agang.GradientSync(model, world[0])  # rank 1 has not joined the broadcast yet
    with pytest.raises(RuntimeError, match=r"await sync.ready\(\)"):
        model(torch.ones(1, 6))
    world[0].close_sync()  # ends the broadcast left pending, and frees its buffer


def test_the_synchronous_api_from_plain_threads() -> None:
    # No event loop: each rank is a plain thread, and FakeWorld completes ops on the
    # thread of the rank that arrives last.
    world = FakeWorld(2)
    reference = make_model(seed=0)
    expected = [
        sum(g) / 2
        for g in zip(*(local_gradients(reference, data(r, 0)) for r in range(2)), strict=True)
    ]
    # Replicas start apart; made here, since `make_model` seeds the global generator.
    models = [make_model(seed=rank) for rank in range(2)]
    results: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    errors: list[BaseException] = []

    def train(rank: int) -> None:
        try:
            model = models[rank]
            sync = agang.GradientSync(model, world[rank])
            sync.ready_sync(timeout=30)
            model(data(rank, 0)).pow(2).sum().backward()
            sync.wait_sync(timeout=30)
            results[rank] = (
                [p.detach().clone() for p in model.parameters()],
                [p.grad.clone() for p in model.parameters()],  # type: ignore[union-attr]
            )
        except BaseException as error:  # re-raised on the test's thread
            errors.append(error)

    threads = [threading.Thread(target=train, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    if errors:
        raise errors[0]
    assert sorted(results) == [0, 1]
    for params, grads in results.values():
        for got, want in zip(params, reference.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach())
        for got, want in zip(grads, expected, strict=True):
            torch.testing.assert_close(got, want)


@pytest.mark.gloo
def test_the_trainer_matches_ddp_on_two_gloo_ranks(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(ROOT / "examples" / "async_trainer.py"),
        "--check-ddp", "--steps", "25", "--hidden", "64", "--no-progress",
    ]  # fmt: skip
    done = subprocess.run(
        command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "DDP check passed: 25 losses and all parameters match" in done.stdout


async def _mean_against_ddp(gang: agang.Gang) -> list[bool]:
    """Four steps of GradientSync and of DDP from the same start, on the same data and
    buckets (the defaults: one here); whether each step's gradients but the first are
    bit-equal. DDP lays its buckets out anew after its first step, in the order the
    gradients came (GradientSync's from the start), and the layout decides the order in
    which Gloo adds each element."""
    synced, reference = make_model(seed=0), make_model(seed=0)
    sync = agang.GradientSync(synced, gang)
    await sync.ready()
    ddp = torch.nn.parallel.DistributedDataParallel(reference)
    equal = []
    for step in range(4):
        x = data(gang.rank, step)
        synced(x).pow(3).sum().backward()
        await sync.wait()
        ddp(x).pow(3).sum().backward()
        if step:
            equal += [
                torch.equal(a.grad, b.grad)  # type: ignore[arg-type]
                for a, b in zip(synced.parameters(), reference.parameters(), strict=True)
            ]
        synced.zero_grad()
        ddp.zero_grad()
    return equal


@pytest.mark.gloo
def test_the_mean_is_ddps_to_the_bit_on_three_gloo_ranks() -> None:
    # With 3 ranks, (a + b + c) / 3 and DDP's a/3 + b/3 + c/3 round differently: each
    # gradient is divided as it enters its bucket, as DDP does.
    results = run_world(_mean_against_ddp, 3)

    for equal in results:
        assert equal == [True] * 18


async def _metric_between_backward_and_wait(gang: agang.Gang) -> tuple[list[float], list[float]]:
    torch.manual_seed(0)
    shared, expert = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    sync = agang.GradientSync(torch.nn.ModuleList([shared, expert]), gang)
    await sync.ready()
    hidden = shared(torch.ones(1, 2))
    if gang.rank == 1:  # rank 0 never uses the expert
        hidden = expert(hidden)
    hidden.sum().backward()
    # As many elements as the one gradient bucket: Gloo would pair the two silently.
    metric = await gang.all_reduce(torch.full((12,), 100.0 * (gang.rank + 1)))
    await sync.wait()
    grads = [p.grad.sum().item() for p in (*shared.parameters(), *expert.parameters())]  # type: ignore[union-attr]
    return metric.tolist(), grads


@pytest.mark.gloo
def test_a_metric_between_backward_and_wait_is_right_on_gloo_when_a_rank_skips_an_expert() -> None:
    results = run_world(_metric_between_backward_and_wait, 2)

    assert [metric for metric, _ in results] == [[300.0] * 12] * 2
    assert results[0][1] == results[1][1]
    torch.manual_seed(0)
    shared, expert = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    shared(torch.ones(1, 2)).sum().backward()
    expert(shared(torch.ones(1, 2))).sum().backward()
    expected = [p.grad.sum().item() / 2 for p in (*shared.parameters(), *expert.parameters())]  # type: ignore[union-attr]
    assert results[0][1] == pytest.approx(expected)


def test_buckets_are_ddps() -> None:
    # Same limits, same buckets as DDP: a bucket closes once it holds at least its limit
    # (a hard cap made more, smaller buckets: 5 against DDP's 3 for the demo's model).
    import random

    import torch.distributed as dist

    from agang._gradient_sync import plan_like_ddp

    chooser = random.Random(0)
    for _ in range(300):
        count = chooser.randint(1, 12)
        tensors = [
            torch.empty(
                chooser.choice([1, 3, 8, 100, 1000, 5000]),
                dtype=chooser.choice([torch.float32, torch.float64]),
            )
            for _ in range(count)
        ]
        first, limit = chooser.choice([(64, 256), (400, 400), (1000, 4000), (10**6, 10**6)])
        expected, _ = dist._compute_bucket_assignment_by_size(tensors, [first, limit])
        items = [((t.dtype, t.device), t.numel() * t.element_size()) for t in tensors]
        assert plan_like_ddp(items, first, limit) == [list(b) for b in expected]
