"""The simulated NCCL across processes, where a launch asks for it: NCCL's behaviour on
a laptop's CPU, one rank per process, under torchrun or any launcher.

Rules:
1. ``AGANG_SIM_NCCL=1`` in a rank's environment (or a world already made on the simulation,
   which ``agang.init`` wraps), makes NCCL the simulation (``agang._backends.sim_nccl``):
   ``init``'s default backend is then ``"nccl"`` (also on a machine without CUDA), its
   device the CPU, and its groups those of the c10d backend ``agang_sim_nccl`` (the name
   ``"nccl"`` is c10d's own, and refuses a torch without NCCL). Inside agang the kind is
   ``"nccl"``: every NCCL path of agang (polling, stream order, abort) runs unchanged.
2. Any other value than unset, empty, ``0`` or ``1`` is refused, naming the variable.
3. A rank checks in with the backend ``nccl-sim``, so real and simulated ranks refuse to
   form one world.
4. The choice is made where it is asked for (``init``'s environment; a weights channel's
   ``open``, by the process's), never by what an earlier call installed: a process that
   simulated NCCL once (a test) still runs Gloo where the variable is unset. NCCL on the
   CPU is the simulation, since real NCCL never runs there.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from agang._backends.sim_nccl.c10d_group import SIM_NCCL_BACKEND
from agang._backends.sim_nccl.process import ProcessSimulation

#: The variable that asks for the simulation (rule 1).
ENV = "AGANG_SIM_NCCL"


def requested(env: Mapping[str, str]) -> bool:
    """Whether ``env`` asks for the simulation (rules 1 and 2)."""
    value = env.get(ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV} must be 1 (simulate NCCL) or 0, but is {value!r} instead.")
    return value == "1"


def install_if_requested(env: Mapping[str, str]) -> bool:
    """Installs the process's simulation where ``env`` asks for it (rule 1); whether it
    did."""
    if requested(env):
        ProcessSimulation.install()
        return True
    return False


def world_is_simulated() -> bool:
    """Whether torch.distributed's world is made already, on the simulation (rule 1)."""
    return bool(dist.is_initialized() and dist.get_backend() == SIM_NCCL_BACKEND)


def c10d_name(backend: str, device: torch.device) -> str:
    """c10d's name of agang's ``backend`` on ``device`` (rule 4)."""
    return SIM_NCCL_BACKEND if backend == "nccl" and device.type == "cpu" else backend


def kind_of(c10d_backend: str) -> str:
    """agang's kind of c10d's backend name (rule 1)."""
    return "nccl" if c10d_backend == SIM_NCCL_BACKEND else c10d_backend


def check_in_name(backend: str, device: torch.device) -> str:
    """The backend a rank checks in with (rule 3)."""
    return "nccl-sim" if backend == "nccl" and device.type == "cpu" else backend
