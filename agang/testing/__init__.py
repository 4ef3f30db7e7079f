"""Tools for testing code that uses agang: fake worlds, real local worlds and a
simulated NCCL."""

from agang._backends.sim_nccl.reduce import reduce_tensors as reduce_tensors
from agang.testing._run_world import WorldRunError as WorldRunError
from agang.testing._run_world import run_world as run_world
from agang.testing._sim_nccl.nccl import SimulatedNccl as SimulatedNccl
from agang.testing._sim_nccl.processes import use_simulated_nccl as use_simulated_nccl
from agang.testing._world.gang import FakeWorld as FakeWorld
from agang.testing._world.gang import FakeWorldGang as FakeWorldGang

__all__ = [
    "FakeWorld",
    "FakeWorldGang",
    "SimulatedNccl",
    "WorldRunError",
    "reduce_tensors",
    "run_world",
    "use_simulated_nccl",
]
