"""NCCL on one GPU (world size 1, a real process group): skipped without CUDA.

The in-process gang would bypass NCCL at world size 1, so these force a real process
group with ``in_process=False``.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator

import pytest
import torch

import agang

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ENV = {
    "RANK": "0",
    "WORLD_SIZE": "1",
    "LOCAL_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "0",
}


@pytest.fixture(scope="module")
def gang() -> Iterator[agang.Gang]:
    gang = agang.init_sync(backend="nccl", env=ENV, in_process=False, timeout=120)
    yield gang
    gang.close_sync()


@pytest.mark.parametrize("op", list(agang.ReduceOp))
def test_all_reduce_is_correct_and_finished_on_the_device(
    gang: agang.Gang, op: agang.ReduceOp
) -> None:
    tensor = torch.arange(1 << 20, device=gang.device, dtype=torch.float32)
    expected = tensor.clone()
    out = gang.all_reduce(tensor, op).wait(timeout=60)

    assert out is tensor
    assert torch.equal(out, expected)  # one rank: every op is the identity


def test_await_means_finished_on_the_device(gang: agang.Gang) -> None:
    # A long kernel queued before the op: the handle must not finish before it does.
    a = torch.randn(4096, 4096, device=gang.device)
    for _ in range(20):
        a = a @ a / 64
    tensor = a.sum(0)
    before = torch.cuda.Event()
    before.record()
    handle = gang.all_reduce(tensor)
    handle.wait(timeout=60)
    assert before.query()  # the kernels queued before the op have finished


def test_object_collectives_and_gathers(gang: agang.Gang) -> None:
    assert gang.all_gather_objects({"a": 1}).wait(timeout=60) == [{"a": 1}]
    assert gang.broadcast_objects([1, "x"]).wait(timeout=60) == [1, "x"]
    out = torch.empty(1, 3, device=gang.device)
    gang.all_gather(out, torch.ones(3, device=gang.device)).wait(timeout=60)
    assert out.tolist() == [[1.0, 1.0, 1.0]]
    gang.barrier().wait(timeout=60)


def test_waiting_does_not_spin_a_core(gang: agang.Gang) -> None:
    a = torch.randn(8192, 8192, device=gang.device)
    for _ in range(10):
        a = a @ a / 128  # ~0.1-1 s of GPU work queued ahead of the op
    handle = gang.all_reduce(a)
    cpu_before, wall_before = time.process_time(), time.perf_counter()
    handle.wait(timeout=120)
    cpu, wall = time.process_time() - cpu_before, time.perf_counter() - wall_before
    assert wall > 0.05
    assert cpu < 0.5 * wall  # a spinning waiter would burn ~100% of a core


def test_a_coalesce_scope_copies_results_back_on_the_device(gang: agang.Gang) -> None:
    tensors = [torch.full((1000,), float(i), device=gang.device) for i in range(16)]
    tensors.append(torch.ones(3, device=gang.device, dtype=torch.float16))
    with gang.coalesce():
        handles = [gang.all_reduce(t, agang.ReduceOp.MAX) for t in tensors]
    outs = [h.wait(timeout=60) for h in handles]
    assert [o[0].item() for o in outs] == [float(i) for i in range(16)] + [1.0]
    out = gang.all_reduce_bucketed(tensors[:16], bucket_bytes=16_000).wait(timeout=60)
    assert out[15][0].item() == 15.0


def test_a_high_priority_lane(gang: agang.Gang) -> None:
    import anyio

    async def use_lane() -> float:
        lane = await gang.lane("fast", high_priority=True)
        return (await lane.all_reduce(torch.ones(4, device=gang.device)))[0].item()

    assert anyio.run(use_lane) == 1.0


def test_gradient_sync_averages_into_buckets_on_the_device(gang: agang.Gang) -> None:
    import anyio

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8)
    ).to(gang.device)
    reference = copy.deepcopy(model)
    x = torch.randn(32, 64, device=gang.device)
    reference(x).pow(2).sum().backward()

    async def step() -> int:
        sync = agang.GradientSync(model, gang)
        await sync.ready()
        model(x).pow(2).sum().backward()
        await sync.wait()
        sync.remove()
        return sync.num_buckets

    assert anyio.run(step) == 1  # ~75 KB: one bucket, under the first bucket's 1 MiB
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.device == gang.device for g in grads)
    # Every gradient is a view of that one bucket: it lives on the device.
    assert len({g.untyped_storage().data_ptr() for g in grads if g is not None}) == 1
    for got, want in zip(grads, reference.parameters(), strict=True):
        torch.testing.assert_close(got, want.grad)  # one rank: the mean is the gradient


def test_selfcheck_passes_on_this_gpu() -> None:
    """``agang selfcheck`` on real NCCL, one GPU (in its own process: its own world)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "agang", "selfcheck"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "agang selfcheck: NCCL on" in done.stdout


def test_rooted_collectives_on_the_device(gang: agang.Gang) -> None:
    # One rank: reduce is the identity, gather copies the input into its row, scatter
    # copies the source's first block out (both layouts go to NCCL as views).
    tensor = torch.arange(8, device=gang.device, dtype=torch.float32)
    expected = tensor.clone()
    assert torch.equal(gang.reduce(tensor, 0, agang.ReduceOp.MEAN).wait(timeout=60), expected)
    stacked = torch.empty(1, 8, device=gang.device)
    assert torch.equal(gang.gather(stacked, tensor, 0).wait(timeout=60)[0], expected)
    flat = torch.empty(8, device=gang.device)
    assert torch.equal(gang.gather(flat, tensor, 0).wait(timeout=60), expected)
    out = torch.empty(8, device=gang.device)
    assert torch.equal(gang.scatter(out, tensor.view(1, 8), 0).wait(timeout=60), expected)


def test_uneven_blocks_on_the_device(gang: agang.Gang) -> None:
    # One rank: its one block goes to itself (all_to_all_single with split sizes), and
    # the uneven all-gather's repeated input is one copy (complex: pairs of reals).
    rows = torch.arange(12, device=gang.device, dtype=torch.float32).view(6, 2)
    out = torch.empty(6, 2, device=gang.device)
    moved = gang.all_to_all(out, rows, output_split_sizes=[6], input_split_sizes=[6])
    assert torch.equal(moved.wait(timeout=60), rows)
    values = torch.randn(3, 2, device=gang.device, dtype=torch.complex64)
    gathered = torch.empty(3, 2, device=gang.device, dtype=torch.complex64)
    handle = gang.all_gather(gathered, values, output_split_sizes=[3])
    assert torch.equal(handle.wait(timeout=60), values)


def test_an_elastic_gang_reforms_onto_a_new_nccl_communicator() -> None:
    """An elastic gang of one on NCCL around an ``agang store``: a reform makes epoch 1
    on a new communicator, and both epochs' all-reduces are exact on the device (in a
    process of its own: this module's world gang is open here)."""
    import os
    import subprocess
    import sys

    store = subprocess.Popen(
        [sys.executable, "-m", "agang", "store", "--port", "0", "--quiet"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert store.stdout is not None
        first_line = store.stdout.readline().strip()
        host, port = first_line.rsplit(" ", 1)[1].rsplit(":", 1)
        env = {
            **os.environ,
            "MASTER_ADDR": host,
            "MASTER_PORT": port,
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
        }
        done = subprocess.run(
            [sys.executable, __file__, "elastic"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    finally:
        store.terminate()
        store.wait(10)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "epochs [0, 1]; exact [True, True]; new communicator True; old closed True" in (
        done.stdout
    ), done.stdout


async def _elastic_on_nccl() -> str:
    gang = await agang.init(
        elastic=agang.Elastic(min_size=1), backend="nccl", device="cuda", timeout=120
    )
    assert isinstance(gang, agang.ElasticGang)
    epochs, exact = [gang.epoch], []
    tensor = torch.full((1 << 16,), 3.0, device=gang.device)
    exact.append(bool((await gang.all_reduce(tensor)).eq(3.0).all()))
    old, old_group = gang, gang.process_group
    gang = await gang.reform(timeout=60)
    epochs.append(gang.epoch)
    exact.append(bool((await gang.all_reduce(tensor)).eq(3.0).all()))
    new_communicator = gang.process_group is not old_group
    await gang.close()
    return (
        f"epochs {epochs}; exact {exact}; new communicator {new_communicator}; "
        f"old closed {old.closed}"
    )


if __name__ == "__main__":
    import sys

    import anyio

    assert sys.argv[1:] == ["elastic"], sys.argv
    print(anyio.run(_elastic_on_nccl), flush=True)
