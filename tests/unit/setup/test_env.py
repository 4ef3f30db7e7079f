"""Reading the world from launcher variables, with plain dicts."""

from __future__ import annotations

import pytest

import agang
from agang._setup.env import SLURM_PORT_BASE, SLURM_PORT_SPAN, parse_nodelist, world_from_env

TORCHRUN = {
    "RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "node0",
    "MASTER_PORT": "29500",
}
SLURM = {
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_JOB_ID": "4242",
}


def _no_scontrol(nodelist: str) -> list[str]:
    return parse_nodelist(nodelist)


def test_torchrun_variables() -> None:
    world = world_from_env(TORCHRUN)

    assert world == agang.WorldInfo(
        rank=1,
        world_size=4,
        local_rank=1,
        master_addr="node0",
        master_port=29500,
        source="torchrun",
        local_world_size=2,
    )


def test_slurm_variables_derive_the_store_host_and_port() -> None:
    world = world_from_env(SLURM, expand_hostnames=_no_scontrol)

    assert world is not None
    assert (world.rank, world.world_size, world.local_rank) == (3, 4, 1)
    assert world.local_world_size == 2
    assert world.master_addr == "gpu07"
    assert world.master_port == SLURM_PORT_BASE + 4242 % SLURM_PORT_SPAN
    assert world.port_is_derived
    assert (world.source, world.job_id) == ("slurm", "4242")


def test_every_slurm_rank_of_a_job_agrees_on_the_store() -> None:
    worlds = [
        world_from_env({**SLURM, "SLURM_PROCID": str(r)}, expand_hostnames=_no_scontrol)
        for r in range(4)
    ]

    assert len({(w.master_addr, w.master_port) for w in worlds if w}) == 1


def test_torchrun_wins_over_slurm_and_master_variables_over_derived_ones() -> None:
    assert world_from_env({**SLURM, **TORCHRUN}).source == "torchrun"  # type: ignore[union-attr]
    world = world_from_env(
        {**SLURM, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}, expand_hostnames=_no_scontrol
    )
    assert world is not None
    assert (world.master_addr, world.master_port, world.port_is_derived) == (
        "10.0.0.1",
        1234,
        False,
    )


def test_no_launcher_means_no_world() -> None:
    assert world_from_env({"PATH": "/bin"}) is None


@pytest.mark.parametrize("marker", ["SLURM_PROCID", "SLURM_NTASKS"])
def test_one_slurm_marker_alone_is_no_world(marker: str) -> None:
    # A process srun did not start (salloc's shell, say) sees the job's SLURM_NTASKS
    # only; SLURM_PROCID alone gives no size. Neither is a rank of a SLURM world.
    env = {**SLURM, "MASTER_ADDR": "10.0.0.1"}
    del env[({"SLURM_PROCID", "SLURM_NTASKS"} - {marker}).pop()]

    assert world_from_env(env, expand_hostnames=_no_scontrol) is None


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({**SLURM, "SLURM_PROCID": "x"}, "`SLURM_PROCID`"),
        ({**SLURM, "SLURM_PROCID": "4"}, "`SLURM_PROCID`"),
        ({**SLURM, "SLURM_NTASKS": "0"}, "`SLURM_NTASKS`"),
        ({**SLURM, "SLURM_LOCALID": "2"}, "`SLURM_LOCALID`"),
        ({**SLURM, "SLURM_JOB_ID": "abc"}, "`SLURM_JOB_ID`"),
        ({k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}, "`SLURM_JOB_NODELIST`"),
        ({**SLURM, "SLURM_TASKS_PER_NODE": "x"}, "`SLURM_NTASKS_PER_NODE`"),
        ({**TORCHRUN, "MASTER_PORT": "70000"}, "`MASTER_PORT`"),
        ({**TORCHRUN, "LOCAL_RANK": "2"}, "`LOCAL_RANK`"),
        ({**TORCHRUN, "RANK": "-1"}, "`RANK`"),
    ],
)
def test_invalid_values_are_named_with_their_value(env: dict[str, str], named: str) -> None:
    with pytest.raises(agang.GangInitError, match=named):
        world_from_env(env, expand_hostnames=_no_scontrol)


def test_a_single_task_slurm_job_needs_no_network_settings() -> None:
    world = world_from_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"})

    assert world is not None
    assert (world.world_size, world.master_addr, world.master_port) == (1, "127.0.0.1", 0)


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node1", ["node1"]),
        ("a,b", ["a", "b"]),
        ("gpu[01-03,7]", ["gpu01", "gpu02", "gpu03", "gpu7"]),
        ("x[9-11]y,z", ["x9y", "x10y", "x11y", "z"]),
    ],
)
def test_nodelists_expand_without_scontrol(nodelist: str, hosts: list[str]) -> None:
    assert parse_nodelist(nodelist) == hosts


def test_local_ranks_get_their_share_of_the_cpus_when_omp_is_unset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os

    import torch

    from agang._setup.process import prepare_process

    world = agang.WorldInfo(0, 2, 0, "127.0.0.1", 1, local_world_size=2)
    chosen: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", chosen.append)
    monkeypatch.setattr(os, "environ", {**os.environ})  # the interface setting stays here
    prepare_process(world, "gloo", torch.device("cpu"), {})
    assert chosen == [max(1, (os.cpu_count() or 1) // 2)]

    chosen.clear()
    prepare_process(world, "gloo", torch.device("cpu"), {"OMP_NUM_THREADS": "4"})
    assert chosen == []  # the user's choice stands
