"""Step time of data-parallel training on 2 local Gloo ranks: agang vs DDP vs a naive loop.

    python bench/bench_training.py [--quick | --smoke] [--case deep|demo|all] [--out DIR]

Two cases: a deep MLP whose gradient is tens of MB in many parameter tensors (25 MiB
buckets), and the README demo's small MLP (``examples/async_trainer.py``: 2.1 MiB in 8
tensors, 1 MiB buckets), where each all-reduce's fixed cost shows. In each, every mode
trains the same model on the same data, from the same start:
- ``agang``: ``agang.GradientSync``; buckets are all-reduced while backward runs, and
  ``await sync.wait()`` precedes the optimizer step.
- ``ddp``: torch's ``DistributedDataParallel`` with the same bucket limit (and a first
  bucket of 1 MiB, as GradientSync's): the same buckets.
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
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import WORLD_SIZE, add_out_argument, format_seconds, percentile, write_plots

import agang
from agang.testing import run_world

MODES = ("agang", "ddp", "naive")


def make_model(payload: dict[str, Any]) -> Any:
    """The case's model: the deep MLP (tens of MB of gradient), or the README demo's
    small one (``examples/async_trainer.py``'s defaults: 3 tanh layers of 512)."""
    import torch

    torch.manual_seed(0)
    width, inputs, outputs = payload["width"], payload["inputs"], payload["outputs"]
    layers: list[torch.nn.Module] = [torch.nn.Linear(inputs, width)]
    if payload["case"] == "demo":
        layers.append(torch.nn.Tanh())
        for _ in range(payload["depth"] - 1):
            layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    else:
        for _ in range(payload["depth"]):
            layers += [torch.nn.LayerNorm(width), torch.nn.Linear(width, width), torch.nn.GELU()]
    layers.append(torch.nn.Linear(width, outputs))
    return torch.nn.Sequential(*layers)


async def measure(payload: dict[str, Any], gang: agang.Gang) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # the two ranks share the machine
    models = {mode: make_model(payload) for mode in MODES}
    bucket_mb = payload["bucket_mb"]  # the same limit for both, as each names it
    sync = agang.GradientSync(models["agang"], gang, bucket_bytes=int(bucket_mb * 2**20))
    await sync.ready()
    ddp = torch.nn.parallel.DistributedDataParallel(models["ddp"], bucket_cap_mb=bucket_mb)
    runners = {"agang": models["agang"], "ddp": ddp, "naive": models["naive"]}
    optimizers = {m: torch.optim.SGD(models[m].parameters(), lr=1e-3) for m in MODES}
    generator = torch.Generator().manual_seed(gang.rank)
    x = torch.randn(payload["batch"], payload["inputs"], generator=generator)
    y = torch.randn(payload["batch"], payload["outputs"], generator=generator)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    # Per mode and step: forward + backward (agang's hooks and issues, DDP's reducer and
    # its wait for the last bucket are inside), then the rest (agang's wait, the naive
    # all-reduces, the optimizer).
    phases: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    timeline: dict[str, Any] = {}

    async def step(mode: str) -> tuple[float, float]:
        """The step's seconds, and those of its forward + backward."""
        await gang.barrier()  # both ranks start the step together
        started = time.perf_counter()
        backward_started = time.monotonic()
        loss = torch.nn.functional.mse_loss(runners[mode](x), y)
        loss.backward()
        backward_finished = time.monotonic()
        backward_seconds = time.perf_counter() - started
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
        return seconds, backward_seconds

    for _ in range(payload["warmup"]):
        for mode in MODES:
            await step(mode)
    hidden = []
    for _ in range(payload["steps"]):
        for mode in MODES:
            seconds, backward_seconds = await step(mode)
            times[mode].append(seconds)
            phases[mode].append((backward_seconds, seconds - backward_seconds))
        hidden.append(timeline["hidden_share"])
    return {
        "times": times,
        "phases": phases,
        "timeline": timeline,
        "hidden": hidden,
        "num_buckets": sync.num_buckets,
        "gradient_bytes": sum(p.numel() * 4 for p in models["agang"].parameters()),
        "num_tensors": len(list(models["agang"].parameters())),
    }


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


_DEEP = {"case": "deep", "width": 1024, "depth": 6, "inputs": 256, "outputs": 16, "batch": 16,
         "bucket_mb": 25.0}  # fmt: skip
_DEMO = {"case": "demo", "width": 512, "depth": 3, "inputs": 64, "outputs": 8, "batch": 64,
         "bucket_mb": 1.0}  # fmt: skip
#: Cases and run sizes: the full run, --quick, and --smoke (plumbing only, for tests).
#: The deep MLP's 25 MiB buckets are DDP's and GradientSync's defaults; the demo uses the
#: README demo's 1 MiB (``--bucket-mb``), on both sides.
PAYLOADS = {
    "full": [{**_DEEP, "warmup": 5, "steps": 30}, {**_DEMO, "warmup": 20, "steps": 150}],
    "quick": [{**_DEEP, "warmup": 2, "steps": 5}, {**_DEMO, "warmup": 5, "steps": 30}],
    "smoke": [{**_DEEP, "width": 64, "depth": 1, "batch": 4, "warmup": 1, "steps": 2}],
}


def report(payload: dict[str, Any], result: dict[str, Any]) -> None:
    """Prints one case's table and its ratios."""
    times = result["times"]
    medians = {m: statistics.median(times[m]) for m in MODES}
    print(
        f"case {payload['case']}: {result['num_tensors']} parameter tensors, "
        f"{result['gradient_bytes'] / 2**20:.1f} MiB of gradient; batch {payload['batch']} "
        f"per rank; buckets of {payload['bucket_mb']:g} MiB: agang {result['num_buckets']}; "
        f"{payload['steps']} steps per mode"
    )
    print("| mode | median step | p90 step | vs DDP | forward+backward | then |")
    print("| --- | --- | --- | --- | --- | --- |")
    for mode in MODES:
        backward = statistics.median(b for b, _ in result["phases"][mode])
        rest = statistics.median(r for _, r in result["phases"][mode])
        print(
            f"| {mode} | {format_seconds(medians[mode])} | "
            f"{format_seconds(percentile(times[mode], 90))} | "
            f"{medians[mode] / medians['ddp']:.2f}x | {format_seconds(backward)} | "
            f"{format_seconds(rest)} |"
        )
    hidden = statistics.median(result["hidden"])
    print(
        f"agang / DDP: {medians['agang'] / medians['ddp']:.2f}x (target <= 1.10x); "
        f"naive / agang: {medians['naive'] / medians['agang']:.2f}x; "
        f"agang hid {100 * hidden:.0f}% of its communication (median step)\n"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--quick", action="store_true", help="fewer steps, for a smoke run")
    sizes.add_argument(
        "--smoke", action="store_true", help="a tiny model, 2 steps: every output, no meaning"
    )
    parser.add_argument(
        "--case", choices=["deep", "demo", "all"], default="all", help="which model to time"
    )
    add_out_argument(parser)
    args = parser.parse_args(argv)
    payloads = PAYLOADS["smoke" if args.smoke else "quick" if args.quick else "full"]
    payloads = [p for p in payloads if args.case in ("all", p["case"])]
    if not payloads:
        parser.error(f"--case {args.case} has no run in this size")
    began = time.monotonic()
    results = {}
    for payload in payloads:
        # OMP_NUM_THREADS keeps agang.init from sizing torch's pool (measure sets 1 thread).
        result = run_world(
            functools.partial(measure, payload),
            WORLD_SIZE,
            timeout=900,
            init_timeout=120,
            op_timeout=120,
            env={"OMP_NUM_THREADS": "1"},
        )[0]
        report(payload, result)
        results[payload["case"]] = {"payload": payload, **result}
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "training.json").write_text(json.dumps({"cases": results}, indent=1))
    written = [out / "training.json"]
    plot = out / "training_timeline.png"
    first = next(iter(results.values()))
    written += write_plots([plot], lambda plt: plot_timeline(plt, first["timeline"], plot))
    print(f"wrote {' and '.join(str(path) for path in written)}")
    print(f"run took {time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
