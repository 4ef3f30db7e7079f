"""The self-check on real GPUs: NCCL through ``agang.init``, one rank per process.

Run alone it is a world of one rank on this process's GPU; under
``torchrun --nproc-per-node N`` it is N ranks, one GPU each. A late peer is a
``torch.cuda._sleep`` kernel on the last rank's current stream. The reference for
GradientSync is torch's ``DistributedDataParallel`` over the same ranks.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from typing import Any

import anyio
import torch
import torch.distributed as dist

from agang._cli.selfcheck.harness import StallEnd
from agang._collective.process_group_gang import ProcessGroupGang
from agang._gang import Gang
from agang._setup.init import init

_ALONE = {
    "RANK": "0",
    "WORLD_SIZE": "1",
    "LOCAL_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "0",
}


def _cycles_per_second(device: torch.device) -> float:
    """How many ``torch.cuda._sleep`` cycles make one second on ``device``."""
    cycles = 50_000_000
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    with torch.cuda.device(device):
        start.record()
        torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]
        end.record()
    end.synchronize()
    return cycles / (float(start.elapsed_time(end)) / 1e3)


class CudaHarness:
    """This process's rank of a real NCCL world (see the module's docstring)."""

    def __init__(self, world: ProcessGroupGang) -> None:
        self._world = world
        self._device = world.device
        self.size = world.size
        self.prints = world.rank == 0
        name = torch.cuda.get_device_name(self._device)
        self.description = f"NCCL on {name} ({self._device}), rank {world.rank} of {world.size}"
        self._cycles = _cycles_per_second(self._device)
        self._made: list[Gang] = []

    @classmethod
    async def open(cls) -> CudaHarness:
        """Joins the world torchrun (or SLURM) describes, or makes a world of one."""
        launched = "RANK" in os.environ or "SLURM_PROCID" in os.environ
        env = None if launched else {**os.environ, **_ALONE}
        world = await init(backend="nccl", device="cuda", env=env, in_process=False, timeout=120)
        assert isinstance(world, ProcessGroupGang)
        return cls(world)

    async def gangs(self, name: str, *, stream_ordered: bool = False) -> list[Gang]:
        world = self._world
        if not stream_ordered:
            gang = await world.lane(name)
        else:
            group = await anyio.to_thread.run_sync(
                lambda: dist.new_group(backend="nccl", device_id=self._device)
            )
            gang = ProcessGroupGang(
                group,
                device=self._device,
                backend="nccl",
                name=name,
                policy=dataclasses.replace(world.policy, check_order=False),
                is_world=False,
                stream_ordered=True,
            )
        self._made.append(gang)
        return [gang]

    def stall(self, seconds: float) -> StallEnd:
        if self._world.rank != self.size - 1:
            return lambda: None
        with torch.cuda.device(self._device):
            torch.cuda._sleep(int(self._cycles * seconds))  # type: ignore[no-untyped-call]
            passed = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            passed.record(torch.cuda.current_stream(self._device))

        def ended_at() -> float | None:
            passed.synchronize()
            return time.monotonic()

        return ended_at

    def mark(self, gang: Gang) -> Any:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self._device))
        return event

    async def settle(self) -> None:
        await anyio.to_thread.run_sync(torch.cuda.synchronize, self._device)

    def reference_gradients(
        self, models: Sequence[torch.nn.Module], inputs: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        from torch.nn.parallel import DistributedDataParallel

        (model,), (x,) = models, inputs
        ddp = DistributedDataParallel(
            model, device_ids=[self._device.index], process_group=self._world.process_group
        )
        ddp(x).square().mean().backward()
        torch.cuda.synchronize(self._device)
        return [torch.cat([p.grad.reshape(-1) for p in model.parameters()])]  # type: ignore[union-attr]

    def device_binding(self) -> tuple[bool, str]:
        current = torch.cuda.current_device()
        ok = current == self._device.index
        figure = f"caller's current device cuda:{current} (gang on {self._device})"
        gpus = _gpus_with_this_process()
        if gpus is not None:
            ok = ok and gpus <= 1
            figure += f"; this process has a context on {gpus} GPU(s) (nvidia-smi)"
        return ok, figure

    def stream_privacy(self, gang: Gang) -> tuple[bool, str] | None:
        side = getattr(
            getattr(getattr(gang, "_backend", None), "_completion", None), "_stream", None
        )
        if side is None:
            return False, "the gang has no side stream after an op"
        draws = [torch.cuda.Stream(device=self._device) for _ in range(64)]  # type: ignore[no-untyped-call]
        aliases = sum(d.cuda_stream == side.cuda_stream for d in draws)
        return aliases == 0, f"{aliases} of 64 new torch streams are the gang's side stream"

    async def gather(self, rows: list[tuple[str, str, str]]) -> list[list[tuple[str, str, str]]]:
        gathered = await self._world.all_gather_objects(rows)
        return [list(r) for r in gathered]

    async def close(self) -> None:
        for gang in self._made:
            await gang.close()
        await self._world.close()


def _gpus_with_this_process() -> int | None:
    """On how many GPUs this process has a context, per nvidia-smi; None without it."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    pid = str(os.getpid())
    return len(
        {
            line.split(",")[1].strip()
            for line in out.splitlines()
            if line.split(",")[0].strip() == pid
        }
    )
