"""Step time of data-parallel training on 2 local Gloo ranks: agang vs DDP vs a naive loop.

    python bench/bench_training.py [--quick | --smoke] [--out DIR]

Every mode trains the same model (an MLP whose gradient is tens of MB, in many
parameter tensors) on the same data, from the same start:
- ``agang``: ``agang.GradientSync``; buckets are all-reduced while backward runs, and
  ``await sync.wait()`` precedes the optimizer step.
- ``ddp``: torch's ``DistributedDataParallel`` with its default buckets (25 MiB, a first
  bucket of 1 MiB), the same caps as GradientSync's defaults.
- ``naive``: backward, then one blocking ``dist.all_reduce`` per parameter, then divide.
Modes take turns step by step (round-robin, after warm-up steps), so noise on this
shared 2-core machine hits them alike; the table gives medians and ratios to DDP. One
agang step's timeline (backward vs each bucket's all-reduce) goes to
bench/out/training_timeline.png (where matplotlib is installed), the figures to
bench/out/training.json. ``--smoke`` is the smallest run that prints the table and writes
every file, for tests: its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    add_out_argument,
    format_seconds,
    percentile,
    run_async_rank,
    run_ranks,
    write_plots,
)

MODES = ("agang", "ddp", "naive")


def make_model(width: int, depth: int) -> Any:
    import torch

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(256, width)]
    for _ in range(depth):
        layers += [torch.nn.LayerNorm(width), torch.nn.Linear(width, width), torch.nn.GELU()]
    layers.append(torch.nn.Linear(width, 16))
    return torch.nn.Sequential(*layers)


async def measure(payload: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import agang

    gang = await agang.init(timeout=120, op_timeout=120)
    models = {mode: make_model(payload["width"], payload["depth"]) for mode in MODES}
    sync = agang.GradientSync(models["agang"], gang)
    await sync.ready()
    ddp = torch.nn.parallel.DistributedDataParallel(models["ddp"])
    runners = {"agang": models["agang"], "ddp": ddp, "naive": models["naive"]}
    optimizers = {m: torch.optim.SGD(models[m].parameters(), lr=1e-3) for m in MODES}
    generator = torch.Generator().manual_seed(gang.rank)
    x = torch.randn(payload["batch"], 256, generator=generator)
    y = torch.randn(payload["batch"], 16, generator=generator)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    timeline: dict[str, Any] = {}

    async def step(mode: str) -> float:
        await gang.barrier()  # both ranks start the step together
        started = time.perf_counter()
        backward_started = time.monotonic()
        loss = torch.nn.functional.mse_loss(runners[mode](x), y)
        loss.backward()
        backward_finished = time.monotonic()
        if mode == "agang":
            await sync.wait()
        elif mode == "naive":
            for param in models["naive"].parameters():
                assert param.grad is not None
                dist.all_reduce(param.grad)
                param.grad.div_(gang.size)
        optimizers[mode].step()
        optimizers[mode].zero_grad()
        seconds = time.perf_counter() - started
        last = sync.last_step()
        if mode == "agang" and last is not None:
            timeline.update(
                forward_backward=(backward_started, backward_finished),
                wait=(last.wait_started, last.wait_finished),
                buckets=[(b.index, b.num_bytes, b.issued_at, b.finished_at) for b in last.buckets],
                hidden_share=last.hidden_share,
            )
        return seconds

    for _ in range(payload["warmup"]):
        for mode in MODES:
            await step(mode)
    hidden = []
    for _ in range(payload["steps"]):
        for mode in MODES:
            times[mode].append(await step(mode))
        hidden.append(timeline["hidden_share"])
    await gang.close()
    return {
        "times": times,
        "timeline": timeline,
        "hidden": hidden,
        "num_buckets": sync.num_buckets,
        "gradient_bytes": sum(p.numel() * 4 for p in models["agang"].parameters()),
        "num_tensors": len(list(models["agang"].parameters())),
    }


def rank_main(env: dict[str, str], payload: dict[str, Any], conn: Connection) -> None:
    run_async_rank(env, conn, lambda: measure(payload))


def plot_timeline(plt: Any, timeline: dict[str, Any], path: Path) -> None:
    """One agang step: compute, and each bucket's all-reduce (``plt``: matplotlib's
    pyplot, see ``_common.write_plots``)."""
    origin = timeline["forward_backward"][0]
    figure, axes = plt.subplots(figsize=(9, 2.8))
    start, end = timeline["forward_backward"]
    axes.barh(1, (end - start) * 1e3, left=0, color="tab:blue", label="forward + backward")
    wait_start, wait_end = timeline["wait"]
    axes.barh(1, (wait_end - wait_start) * 1e3, left=(wait_start - origin) * 1e3,
              color="tab:red", label="waiting for communication")  # fmt: skip
    for index, num_bytes, issued, finished in timeline["buckets"]:
        axes.barh(0, (finished - issued) * 1e3, left=(issued - origin) * 1e3,
                  color="tab:green", edgecolor="black")  # fmt: skip
        label = f"b{index} {num_bytes / 2**20:.1f} MiB"
        axes.text((issued - origin) * 1e3, -0.45 + 0.12 * index, label, fontsize=7)
    axes.set_yticks([0, 1], ["all-reduce\n(buckets)", "compute"])
    axes.set_xlabel("ms since forward started (rank 0, one agang step)")
    axes.set_title(f"GradientSync: {100 * timeline['hidden_share']:.0f}% of communication hidden")
    axes.legend(loc="upper right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


#: Model and run sizes: the full run, --quick, and --smoke (plumbing only, for tests).
PAYLOADS = {
    "full": {"width": 1024, "depth": 6, "batch": 16, "warmup": 5, "steps": 30},
    "quick": {"width": 1024, "depth": 6, "batch": 16, "warmup": 2, "steps": 5},
    "smoke": {"width": 64, "depth": 1, "batch": 4, "warmup": 1, "steps": 2},
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--quick", action="store_true", help="fewer steps, for a smoke run")
    sizes.add_argument(
        "--smoke", action="store_true", help="a tiny model, 2 steps: every output, no meaning"
    )
    add_out_argument(parser)
    args = parser.parse_args(argv)
    payload = PAYLOADS["smoke" if args.smoke else "quick" if args.quick else "full"]
    began = time.monotonic()
    result = run_ranks(rank_main, payload, timeout=900)[0]
    times = result["times"]
    medians = {m: statistics.median(times[m]) for m in MODES}
    print(
        f"model: {result['num_tensors']} parameter tensors, "
        f"{result['gradient_bytes'] / 2**20:.1f} MiB of gradient; batch {payload['batch']} "
        f"per rank; agang buckets: {result['num_buckets']}; {payload['steps']} steps per mode"
    )
    print("| mode | median step | p90 step | vs DDP |")
    print("| --- | --- | --- | --- |")
    for mode in MODES:
        print(
            f"| {mode} | {format_seconds(medians[mode])} | "
            f"{format_seconds(percentile(times[mode], 90))} | "
            f"{medians[mode] / medians['ddp']:.2f}x |"
        )
    hidden = statistics.median(result["hidden"])
    print(
        f"agang / DDP: {medians['agang'] / medians['ddp']:.2f}x (target <= 1.10x); "
        f"naive / agang: {medians['naive'] / medians['agang']:.2f}x (target >= 1.3x); "
        f"agang hid {100 * hidden:.0f}% of its communication (median step)"
    )
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "training.json").write_text(json.dumps({"payload": payload, **result}, indent=1))
    plot = out / "training_timeline.png"
    written = [out / "training.json"]
    written += write_plots([plot], lambda plt: plot_timeline(plt, result["timeline"], plot))
    print(f"wrote {' and '.join(str(path) for path in written)}")
    print(f"run took {time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
