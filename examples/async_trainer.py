"""Async data-parallel training: gradients are all-reduced while backward still runs.

Each rank trains a replica of a small MLP on its own shard of synthetic regression data.
``agang.GradientSync`` all-reduces the gradient buckets as backward produces them;
``await sync.wait()`` collects them before the optimizer step, without ever blocking
the event loop.

    python examples/async_trainer.py                                  # one process
    torchrun --standalone --nproc-per-node 2 examples/async_trainer.py --check-ddp

``--check-ddp`` then trains the same model, data and seed with torch's
DistributedDataParallel and checks that every step's loss and the final parameters match.
The two train in turns, one DDP step after each agang step, so that both see the
machine in the same state (run one after the other, agang's run, going first, measured
1.10-1.17x DDP's step here while ``bench/bench_training.py``, which takes turns, gave
1.08x), and their median step times are compared, each leaving out its first 10 steps
(one-time costs).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tqdm import tqdm

import agang

DIMENSIONS = (64, 8)  # inputs, outputs
WARM_UP = 10  # steps left out of the median step time


@dataclass
class Run:
    losses: list[float]
    parameters: list[torch.Tensor]
    seconds: float
    hidden_shares: list[float]
    step_seconds: list[float]

    def median_step(self) -> float:
        """The median time of a step once warm (the first ``WARM_UP`` steps left out:
        they pay one-time costs, first allocations and first kernels, that a comparison
        between two runs in one process would charge to whichever runs first)."""
        return statistics.median(self.step_seconds[WARM_UP:] or self.step_seconds)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=150, help="training steps")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank and step")
    parser.add_argument("--hidden", type=int, default=512, help="width of the MLP")
    parser.add_argument("--layers", type=int, default=3, help="hidden layers")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    parser.add_argument("--bucket-mb", type=float, default=1.0, help="gradient bucket size, MiB")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and data")
    parser.add_argument("--check-ddp", action="store_true", help="compare with torch DDP")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.hidden < 1 or args.layers < 1:
        parser.error("--steps, --batch, --hidden and --layers must be positive")
    if args.bucket_mb <= 0:
        parser.error("--bucket-mb must be positive")
    return args


def make_model(args: argparse.Namespace, rank: int, device: torch.device) -> torch.nn.Module:
    # Seeded by rank on purpose: replicas start apart, and the broadcast (GradientSync's
    # or DDP's) makes them equal.
    torch.manual_seed(args.seed * 1000 + rank)
    inputs, outputs = DIMENSIONS
    layers: list[torch.nn.Module] = []
    width = inputs
    for _ in range(args.layers):
        layers += [torch.nn.Linear(width, args.hidden), torch.nn.Tanh()]
        width = args.hidden
    layers.append(torch.nn.Linear(width, outputs))
    return torch.nn.Sequential(*layers).to(device)


def batch(
    args: argparse.Namespace, rank: int, step: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of step ``step``: a fixed teacher map plus noise."""
    teacher = torch.Generator().manual_seed(args.seed)
    weight = torch.randn(DIMENSIONS, generator=teacher)
    data = torch.Generator().manual_seed((args.seed * 1_000_003 + step) * 1009 + rank)
    x = torch.randn(args.batch, DIMENSIONS[0], generator=data)
    y = torch.tanh(x @ weight) + 0.01 * torch.randn(args.batch, DIMENSIONS[1], generator=data)
    return x.to(device), y.to(device)


def progress(args: argparse.Namespace, rank: int, label: str) -> tqdm[int]:
    return tqdm(range(args.steps), desc=label, disable=rank != 0 or args.no_progress, leave=False)


async def train_with_agang(
    args: argparse.Namespace, gang: agang.Gang, alongside: DdpRun | None = None
) -> Run:
    """Trains with agang; ``alongside``, when given, takes one DDP step after each
    agang step (untimed here), so both runs see the machine in the same state."""
    model = make_model(args, gang.rank, gang.device)
    sync = agang.GradientSync(model, gang, bucket_bytes=int(args.bucket_mb * 2**20))
    await sync.ready()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    losses, hidden, steps = [], [], []
    bar = progress(args, gang.rank, "agang" if alongside is None else "agang and DDP")
    for step in bar:
        step_started = time.perf_counter()
        x, y = batch(args, gang.rank, step, gang.device)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # buckets are all-reduced as backward produces them
        await sync.wait()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        steps.append(time.perf_counter() - step_started)
        last = sync.last_step()
        if last is not None:
            hidden.append(last.hidden_share)
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
        if alongside is not None:
            alongside.step(step)
    sync.remove()
    return Run(losses, [p.detach().cpu() for p in model.parameters()], sum(steps), hidden, steps)


class DdpRun:
    """The same training with torch's DistributedDataParallel, one step at a time."""

    def __init__(self, args: argparse.Namespace, rank: int, device: torch.device) -> None:
        self.args, self.rank, self.device = args, rank, device
        self.model = make_model(args, rank, device)
        self.ddp = torch.nn.parallel.DistributedDataParallel(
            self.model,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=args.bucket_mb,
        )
        self.optimizer = torch.optim.SGD(self.ddp.parameters(), lr=args.lr, momentum=0.9)
        self.losses: list[float] = []
        self.steps: list[float] = []

    def step(self, step: int) -> None:
        step_started = time.perf_counter()
        x, y = batch(self.args, self.rank, step, self.device)
        loss = torch.nn.functional.mse_loss(self.ddp(x), y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.losses.append(loss.item())
        self.steps.append(time.perf_counter() - step_started)

    def run(self) -> Run:
        parameters = [p.detach().cpu() for p in self.model.parameters()]
        return Run(self.losses, parameters, sum(self.steps), [], self.steps)


def compare(ours: Run, theirs: Run, *, tolerance: float = 1e-4) -> str | None:
    """None if the runs match within ``tolerance`` (relative), else what differs."""
    for step, (a, b) in enumerate(zip(ours.losses, theirs.losses, strict=True)):
        if abs(a - b) > tolerance * max(abs(b), 1e-3):
            return f"loss at step {step}: agang {a!r}, DDP {b!r}"
    for i, (a, b) in enumerate(zip(ours.parameters, theirs.parameters, strict=True)):
        if not torch.allclose(a, b, rtol=tolerance, atol=tolerance * 1e-2):
            return f"parameter {i}: max difference {(a - b).abs().max().item():.3g}"
    return None


def largest_difference(ours: Run, theirs: Run) -> float:
    return max(
        (a - b).abs().max().item() for a, b in zip(ours.parameters, theirs.parameters, strict=True)
    )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def main(argv: list[str] | None = None, say: Callable[[str], None] = print) -> int:
    args = parse(argv)
    env = dict(os.environ)
    if args.check_ddp and "WORLD_SIZE" not in env:
        # DDP needs a real process group, even for one process.
        env |= {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    gang = await agang.init(env=env, in_process=False if args.check_ddp else None)
    try:
        # With --check-ddp, DDP trains alongside, a step after each of agang's.
        ddp = DdpRun(args, gang.rank, gang.device) if args.check_ddp else None
        run = await train_with_agang(args, gang, ddp)
        total = torch.tensor([run.losses[-1]], device=gang.device)
        final_loss = (await gang.all_reduce(total, agang.ReduceOp.MEAN)).item()
        if gang.rank == 0:
            hidden = statistics.mean(run.hidden_shares) if run.hidden_shares else 1.0
            say(
                f"agang: {gang.size} rank(s), {args.steps} steps in {run.seconds:.2f} s "
                f"(median step {1e3 * run.median_step():.2f} ms); communication hidden behind "
                f"backward: {100 * hidden:.0f}%; final loss {final_loss:.5f} "
                f"(first {run.losses[0]:.5f})"
            )
        if ddp is None:
            return 0
        reference = ddp.run()
        mismatch = compare(run, reference)
        verdict = torch.tensor([0 if mismatch is None else 1], device=gang.device)
        await gang.all_reduce(verdict, agang.ReduceOp.MAX)
        if mismatch is not None:
            say(f"rank {gang.rank}: agang and DDP differ: {mismatch}")
        elif gang.rank == 0:
            say(
                f"DDP check passed: {args.steps} losses and all parameters match "
                f"(largest parameter difference {largest_difference(run, reference):.2g}); "
                f"DDP took {reference.seconds:.2f} s (median step "
                f"{1e3 * reference.median_step():.2f} ms); agang/DDP per step "
                f"{run.median_step() / reference.median_step():.2f}x"
            )
        return int(verdict.item())
    finally:
        await gang.close()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    try:
        import uvloop

        sys.exit(uvloop.run(main()))
    except ImportError:  # pragma: no cover - uvloop is a dependency, but not on Windows
        sys.exit(asyncio.run(main()))
