"""What a rank's process is set up with before its process group exists: its device and
c10d backend, and the settings c10d, NCCL and torch read from the process.

Which device and backend (``resolve_device``, ``resolve_backend``): the
arguments of ``agang.init`` where given, else from the world and this machine (a CUDA
device and NCCL where CUDA is available, else the CPU and Gloo).

Each setting ``prepare_process`` makes is made only where the user has not made it,
and logged:
1. The network interface of the ranks' connections (``agang._setup.interface``): the one
   that reaches ``MASTER_ADDR``, for Gloo (and NCCL); a loopback ``MASTER_ADDR`` in a
   job across hosts fails at once.
2. On NCCL, the GPU as this thread's device and the settings of ``NCCL_SETTINGS``
   (abort the communicator and keep the process; no heartbeat monitor that kills it), so
   an agang deadline is survivable.
3. With several local ranks and no ``OMP_NUM_THREADS``, each rank gets its share of the
   CPUs, so they do not oversubscribe the machine.
4. c10d's C++ log stays quiet while the store is opened, unless the user asked for it
   (``agang._backends.c10d.log``); what set-up does with it is logged.

The NCCL settings are data, a name mapped to (value, why), because two readers need
them: ``apply_nccl_settings`` here, and ``agang doctor``, which reports a user's value
that differs. One table keeps the two from drifting apart. Why each one:

- ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``: on a failed or timed-out op, c10d aborts the
  communicator and keeps the process (1 and 3 kill it), so an agang deadline is
  survivable and the gang can report ``GangTimeoutError``.
- ``TORCH_NCCL_ENABLE_MONITORING=0``: the default group's heartbeat monitor kills every
  rank (SIGABRT) some minutes after any c10d-side timeout or error was signalled, whatever
  the error-handling mode. agang's own deadlines fail and abort the gang instead.
- ``TORCH_NCCL_DUMP_ON_TIMEOUT=0``: no flight-recorder dump signal to every rank on a
  c10d-side timeout (the first step towards that kill); agang's ``GangTimeoutError``
  carries its own flight recorder.

A launcher's value is not the user's. torchrun's agent puts
``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` (tear the process down) into every worker's
environment unless the variable was set for the agent itself, so under torchrun agang
would never see it unset, and an NCCL error would kill the process instead of reaching
the program (an elastic gang could never re-form). A worker cannot tell that default
from a 1 the user exported, so ``LAUNCHER_DEFAULTS`` names it: where a worker of the
launcher holds exactly the launcher's value, agang applies its own and logs why, unless
``AGANG_KEEP_NCCL_SETTINGS=1`` asks it to keep every value as found. Any other value is
the user's and is kept.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping

import torch

from agang._backends.c10d import log as c10d_log
from agang._setup.env import WorldInfo
from agang._setup.interface import apply_interface, check_master_reachable

log = logging.getLogger("agang.setup")

#: Name -> (agang's value, why), in the order they are applied.
NCCL_SETTINGS: dict[str, tuple[str, str]] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": ("2", "survive a timeout in-process"),
    "TORCH_NCCL_ENABLE_MONITORING": (
        "0",
        "agang's deadlines replace the heartbeat monitor, which kills the process",
    ),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": ("0", "agang's timeout errors carry the flight recorder"),
}
#: Name -> (the launcher, the variable that marks its workers, the value it sets there).
LAUNCHER_DEFAULTS: dict[str, tuple[str, str, str]] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": ("torchrun", "TORCHELASTIC_RUN_ID", "1"),
}
#: Set to 1 to keep every NCCL setting as found, a launcher's default included.
KEEP_NCCL_SETTINGS = "AGANG_KEEP_NCCL_SETTINGS"


# The device and the backend.


def resolve_device(device: object, backend: str | None, world: WorldInfo | None) -> torch.device:
    """The gang's device: ``device`` if given, else ``cuda:LOCAL_RANK`` (modulo the GPUs
    here) when CUDA is available and the backend allows it, else the CPU.

    A bare ``"cuda"`` means this rank's GPU, as ``None`` does: every later step needs an
    index (``torch.cuda.set_device``, ``init_process_group(device_id=...)``, and the
    check that a tensor is on the gang's device, which ``cuda`` and ``cuda:0`` fail).
    """
    if device is not None:
        try:
            chosen = torch.device(device)  # type: ignore[call-overload]
        except (RuntimeError, TypeError) as exc:
            raise ValueError(
                f"`device` must be a torch.device or a device string, but is {device!r} instead."
            ) from exc
        if chosen.type != "cuda" or chosen.index is not None:
            return chosen  # type: ignore[no-any-return]
        if not torch.cuda.is_available():
            raise ValueError(
                f"`device` must be a device this machine has, but is {device!r} and CUDA is "
                f"not available here."
            )
        return torch.device("cuda", _local_gpu(world))
    if backend != "gloo" and torch.cuda.is_available():
        return torch.device("cuda", _local_gpu(world))
    return torch.device("cpu")


def _local_gpu(world: WorldInfo | None) -> int:
    local_rank = world.local_rank if world is not None else 0
    return local_rank % torch.cuda.device_count()


def resolve_backend(backend: object, device: torch.device, *, simulated: bool = False) -> str:
    """The c10d backend: ``backend`` if given and it fits ``device``, else by device.
    ``simulated``: NCCL is the simulation (``agang._setup.simulation``), on the CPU."""
    if backend is None:
        return "nccl" if device.type == "cuda" or simulated else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"`backend` must be 'gloo', 'nccl' or None, but is {backend!r} instead.")
    if backend == "nccl" and simulated and device.type != "cpu":
        raise ValueError(
            f"`device` must be the CPU for the simulated 'nccl' backend (AGANG_SIM_NCCL=1), "
            f"but is {device} instead."
        )
    if backend == "nccl" and device.type != "cuda" and not simulated:
        raise ValueError(
            f"`device` must be a CUDA device for the 'nccl' backend, but is {device} instead."
        )
    if backend == "gloo" and device.type != "cpu":
        raise ValueError(
            f"`device` must be the CPU for the 'gloo' backend, but is {device} instead."
        )
    return str(backend)


# The process's settings.


def prepare_process(
    world: WorldInfo, backend: str, device: torch.device, env: Mapping[str, str]
) -> None:
    """Applies rules 1 to 4 to this process (``env`` is the launcher's view of it)."""
    announce_c10d_log(os.environ)
    check_master_reachable(world.master_addr, world.world_size, world.local_world_size)
    apply_interface(world.master_addr, os.environ, nccl=backend == "nccl")
    if backend == "nccl":
        if device.type == "cuda":  # not the simulation's CPU
            torch.cuda.set_device(device)
        apply_nccl_settings(os.environ)
    local = world.local_world_size or 1
    if local > 1 and "OMP_NUM_THREADS" not in env:
        threads = max(1, (os.cpu_count() or 1) // local)
        torch.set_num_threads(threads)
        log.info(
            "agang: OMP_NUM_THREADS is unset and %d ranks share this machine: each uses %d "
            "CPU thread%s.",
            local,
            threads,
            "" if threads == 1 else "s",
        )


def launcher_default(environ: Mapping[str, str], name: str) -> str | None:
    """The launcher whose default ``name`` holds in ``environ``, which agang replaces with
    its own value; None where the value is unset, the user's, or to be kept."""
    if name not in LAUNCHER_DEFAULTS or environ.get(KEEP_NCCL_SETTINGS) == "1":
        return None
    launcher, marker, value = LAUNCHER_DEFAULTS[name]
    return launcher if marker in environ and environ.get(name) == value else None


def apply_nccl_settings(environ: MutableMapping[str, str]) -> dict[str, str]:
    """Sets every NCCL setting the user left unset, or a launcher set for them; returns
    what it set."""
    made = {}
    for name, (value, why) in NCCL_SETTINGS.items():
        launcher = launcher_default(environ, name)
        if name in environ and launcher is None:
            continue
        if launcher is not None:
            log.warning(
                "agang: %s=%s is %s's default for its workers; agang sets %s (%s). "
                "Set %s=1 to keep it.",
                name,
                environ[name],
                launcher,
                value,
                why,
                KEEP_NCCL_SETTINGS,
            )
        else:
            log.info("agang: set %s=%s (%s).", name, value, why)
        environ[name] = value
        made[name] = value
    return made


def announce_c10d_log(env: Mapping[str, str]) -> bool:
    """Logs, at INFO, what set-up does with c10d's log in this process; returns whether
    it is quiet. Called once per init, beside the other settings agang makes."""
    wanted = c10d_log.c10d_output_wanted(env)
    if wanted is not None:
        log.info("agang: %s is set: c10d's own log output is left as torch makes it.", wanted)
        return False
    if not c10d_log.can_quiet():
        log.info("agang: c10d's log cannot be quieted on this torch build; it is left as is.")
        return False
    log.info(
        "agang: c10d's log is quiet while this rank opens the store (its C++ traces of "
        "connection retries); set %s=1 to see it.",
        c10d_log.DEBUG_VARIABLE,
    )
    return True
