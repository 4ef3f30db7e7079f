"""What a rank's process is set up with before its process group exists.

Each setting is made only where the user has not made it, and logged:
1. The network interface of the ranks' connections (``agang._setup.interface``): the one
   that reaches ``MASTER_ADDR``, for Gloo (and NCCL); a loopback ``MASTER_ADDR`` in a
   job across hosts fails at once.
2. On NCCL, the GPU as this thread's device and the settings of
   ``agang._setup.nccl_env`` (abort the communicator and keep the process; no heartbeat
   monitor that kills it), so an agang deadline is survivable.
3. With several local ranks and no ``OMP_NUM_THREADS``, each rank gets its share of the
   CPUs, so they do not oversubscribe the machine.
4. c10d's C++ log stays quiet while the store is opened, unless the user asked for it
   (``agang._setup.c10d_log``); what set-up does with it is logged.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch

from agang._setup import c10d_log
from agang._setup.env import WorldInfo
from agang._setup.interface import apply_interface, check_master_reachable
from agang._setup.nccl_env import apply_nccl_settings

log = logging.getLogger("agang")


def prepare_process(
    world: WorldInfo, backend: str, device: torch.device, env: Mapping[str, str]
) -> None:
    """Applies rules 1 to 4 to this process (``env`` is the launcher's view of it)."""
    c10d_log.announce(os.environ)
    check_master_reachable(world.master_addr, world.world_size, world.local_world_size)
    apply_interface(world.master_addr, os.environ, nccl=backend == "nccl")
    if backend == "nccl":
        torch.cuda.set_device(device)
        apply_nccl_settings(os.environ)
    local = world.local_world_size or 1
    if local > 1 and "OMP_NUM_THREADS" not in env:
        threads = max(1, (os.cpu_count() or 1) // local)
        torch.set_num_threads(threads)
        log.info(
            "agang: OMP_NUM_THREADS is unset and %d ranks share this machine: each uses %d "
            "CPU threads.",
            local,
            threads,
        )
