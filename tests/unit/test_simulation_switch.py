"""The switch to the simulated NCCL across processes (``AGANG_SIM_NCCL``): what it
accepts, and the backend and device it gives ``agang.init``."""

from __future__ import annotations

import pytest
import torch

from agang._setup import simulation
from agang._setup.process import resolve_backend


@pytest.mark.parametrize(
    ("value", "asked"), [("", False), ("0", False), ("1", True), (" 1 ", True)]
)
def test_the_variable_asks_for_the_simulation_with_1(value: str, asked: bool) -> None:
    assert simulation.requested({"AGANG_SIM_NCCL": value}) is asked
    assert simulation.requested({}) is False


@pytest.mark.parametrize("value", ["2", "yes", "true"])
def test_any_other_value_is_refused_naming_the_variable(value: str) -> None:
    with pytest.raises(ValueError, match=r"AGANG_SIM_NCCL must be 1 .* or 0"):
        simulation.requested({"AGANG_SIM_NCCL": value})


def test_under_the_simulation_nccl_is_the_default_and_runs_on_the_cpu() -> None:
    cpu = torch.device("cpu")
    assert resolve_backend(None, cpu, simulated=True) == "nccl"
    assert resolve_backend("nccl", cpu, simulated=True) == "nccl"
    assert resolve_backend("gloo", cpu, simulated=True) == "gloo"
    with pytest.raises(ValueError, match="must be the CPU for the simulated 'nccl'"):
        resolve_backend("nccl", torch.device("cuda", 0), simulated=True)


def test_without_it_nccl_still_needs_a_cuda_device() -> None:
    with pytest.raises(ValueError, match="must be a CUDA device for the 'nccl' backend"):
        resolve_backend("nccl", torch.device("cpu"))


def test_nccl_on_the_cpu_is_the_simulation_by_name_and_at_check_in() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert simulation.c10d_name("nccl", cpu) == "agang_sim_nccl"
    assert simulation.c10d_name("nccl", gpu) == "nccl"
    assert simulation.c10d_name("gloo", cpu) == "gloo"
    assert simulation.kind_of("agang_sim_nccl") == "nccl"
    assert simulation.kind_of("gloo") == "gloo"
    # Real and simulated ranks check in differently, so they refuse one another.
    assert simulation.check_in_name("nccl", cpu) == "nccl-sim"
    assert simulation.check_in_name("nccl", gpu) == "nccl"
