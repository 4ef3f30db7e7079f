"""``use_simulated_nccl``: the simulated NCCL across processes, for a program that makes
its own groups with torch.distributed (agang's own set-up selects it from
``AGANG_SIM_NCCL=1``)."""

from __future__ import annotations

from agang._backends.sim_nccl.c10d_group import SIM_NCCL_BACKEND
from agang._backends.sim_nccl.process import ProcessSimulation
from agang._validate import check_timeout


def use_simulated_nccl(*, watchdog_timeout: float | None = None) -> str:
    """Makes this process's simulated GPU, registers the c10d backend that runs NCCL's
    behaviour on it across processes, and returns that backend's name
    (``"agang_sim_nccl"``), for ``torch.distributed.init_process_group`` and ``new_group``.

    Each process is one rank with its own simulated device (streams, events, kernels, as
    [`SimulatedNccl`][agang.testing.SimulatedNccl] models them); a communicator's
    collectives meet the other processes' over a Gloo group of its own, so results are
    bit for bit those of ``SimulatedNccl`` and ``FakeWorld``. As on NCCL: Work is done
    at enqueue, a kernel runs in its stream's order, errors are in ``exception()``,
    ``abort()`` makes this rank's pending kernels exit, the watchdog fails what outlives
    c10d's timeout, and a rank killed mid-collective leaves its peers' kernels pending
    until they abort. Tensors are CPU tensors; ``wait()`` orders the caller's stream and
    does not block, so a program reads a result after ``await`` in agang (or once
    ``is_completed()``), never right after a raw ``wait()``.

    agang programs need not call it: ``AGANG_SIM_NCCL=1`` in each rank's environment
    makes ``agang.init`` (and a weights channel's ``open``) use the simulation, e.g.
    ``AGANG_SIM_NCCL=1 torchrun --nproc-per-node 2 train.py``. Calling it again returns
    the same name; the first call's ``watchdog_timeout`` holds.

    Args:
        watchdog_timeout: Seconds after which a pending op fails and its communicator is
            aborted on this rank, as c10d's watchdog does; None: the timeout the group
            was made with.

    Returns:
        The c10d backend's name.

    Example:
        <!-- not-run: it joins the world a launcher (torchrun) set up, one rank a process -->
        ```python
        import torch
        import torch.distributed as dist

        from agang.testing import use_simulated_nccl

        dist.init_process_group(use_simulated_nccl())  # under torchrun
        work = dist.all_reduce(torch.ones(4), async_op=True)
        while not work.is_completed():  # NCCL's Work: done at enqueue, so poll
            pass
        ```
    """
    seconds = check_timeout(watchdog_timeout, name="watchdog_timeout")
    ProcessSimulation.install(watchdog_timeout=seconds)
    return SIM_NCCL_BACKEND
