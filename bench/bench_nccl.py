"""agang on real NCCL against raw c10d, one GPU, measured in the same run.

    python bench/bench_nccl.py [--rounds R] [--loop asyncio|uvloop]

Needs a CUDA GPU (it says so and exits 0 without one: ``bench_nccl_sim.py`` is the CPU
stand-in). A world of one rank over a real NCCL process group (``in_process=False``),
so every op goes through NCCL, its stream and agang's completion path. Per message
size, three ways to finish an all-reduce, interleaved round by round:
- raw blocking: ``dist.all_reduce(t)`` then a synchronize of the current stream, what a
  blocking c10d caller pays to know the result is on the device;
- agang: ``await gang.all_reduce(t)`` (done = finished on the device; the loop is free
  meanwhile), and how much of it the call itself takes (issuing, before the ``await``);
- agang stream-ordered: the same on a gang with ``stream_ordered=True`` (done = ordered
  on the caller's stream), then a synchronize, to compare like with like.
Prints the median microseconds per op over the rounds and each ratio to raw blocking.
One rank has no peer to wait for: this is agang's own cost on the device path, not a
network's.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import anyio
import torch
import torch.distributed as dist

import agang

_ENV = {
    "RANK": "0",
    "WORLD_SIZE": "1",
    "LOCAL_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "0",
}
_SIZES = [(4, 300), (4 << 20, 100), (64 << 20, 20)]  # bytes, ops per round


def _raw(tensor: torch.Tensor, group: dist.ProcessGroup, ops: int) -> float:
    stream = torch.cuda.current_stream(tensor.device)
    started = time.perf_counter()
    for _ in range(ops):
        dist.all_reduce(tensor, group=group)
        stream.synchronize()
    return (time.perf_counter() - started) / ops


async def _agang(tensor: torch.Tensor, gang: agang.Gang, ops: int, issuing: list[float]) -> float:
    issued = 0.0
    started = time.perf_counter()
    for _ in range(ops):
        before = time.perf_counter()
        handle = gang.all_reduce(tensor)
        issued += time.perf_counter() - before
        await handle
    issuing.append(issued / ops)
    return (time.perf_counter() - started) / ops


async def _ordered(tensor: torch.Tensor, gang: agang.Gang, ops: int) -> float:
    stream = torch.cuda.current_stream(tensor.device)
    started = time.perf_counter()
    for _ in range(ops):
        await gang.all_reduce(tensor)
        stream.synchronize()
    return (time.perf_counter() - started) / ops


async def main(rounds: int) -> None:
    world = await agang.init(backend="nccl", device="cuda", env=_ENV, in_process=False)
    assert isinstance(world, agang.ProcessGroupGang)
    device = world.device
    raw_group = dist.new_group(backend="nccl", device_id=device)
    lane = await world.lane("bench")
    ordered_group = dist.new_group(backend="nccl", device_id=device)
    ordered = agang.ProcessGroupGang(
        ordered_group,
        device=device,
        backend="nccl",
        name="ordered",
        policy=dataclasses.replace(world.policy, check_order=False),
        is_world=False,
        stream_ordered=True,
    )
    print(f"agang on NCCL, {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    print(
        f"{'size':>8}  {'raw blocking':>12}  {'agang':>16}  {'of it issuing':>13}  "
        f"{'agang stream-ordered':>22}"
    )
    for num_bytes, ops in _SIZES:
        tensor = torch.ones(max(1, num_bytes // 4), device=device)
        samples: dict[str, list[float]] = {"raw": [], "agang": [], "ordered": [], "issue": []}
        for _ in range(rounds + 1):  # the first round warms up
            samples["raw"].append(_raw(tensor, raw_group, ops))
            samples["agang"].append(await _agang(tensor, lane, ops, samples["issue"]))
            samples["ordered"].append(await _ordered(tensor, ordered, ops))
        med = {name: statistics.median(values[1:]) * 1e6 for name, values in samples.items()}
        raw = med["raw"]
        print(
            f"{_size(num_bytes):>8}  {raw:>9.0f} us  {med['agang']:>6.0f} us "
            f"{med['agang'] / raw:>5.2f}x  {med['issue']:>10.0f} us  "
            f"{med['ordered']:>13.0f} us {med['ordered'] / raw:>5.2f}x"
        )
    await ordered.close()
    await lane.close()
    dist.destroy_process_group(raw_group)
    await world.close()


def _size(num_bytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale:
            return f"{num_bytes // scale} {unit}"
    return f"{num_bytes} B"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--rounds", type=_positive, default=5, help="measured rounds")
    parser.add_argument(
        "--loop", choices=["asyncio", "uvloop"], default="asyncio", help="the event loop"
    )
    arguments = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_nccl: no CUDA GPU here; bench/bench_nccl_sim.py measures the CPU side.")
    else:
        anyio.run(
            main,
            arguments.rounds,
            backend="asyncio",
            backend_options={"use_uvloop": arguments.loop == "uvloop"},
        )
