"""``agang doctor`` under a launcher prints one report per node, not one per rank.

Each node's local rank 0 prints the report, headed by the host and the ranks it speaks
for; every other rank prints only the problems that are its own (a launcher variable of
its own), else nothing. The exit status stays each rank's own.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence

import pytest
from doctor_hosts import CPU_HOST
from netutil import free_port

from agang._cli.doctor.command import run_doctor
from agang._cli.doctor.links import LinkState
from agang._setup.interface import Choice


class ReachableNetwork:
    """Every name resolves to 10.0.0.1, on eth0; every bind and connect succeeds."""

    def resolve(self, host: str) -> Sequence[str]:
        return ["10.0.0.1"]

    def bind(self, address: str, port: int) -> None:
        pass

    def connect(self, address: str, port: int) -> None:
        pass

    def interface(self, host: str, env: Mapping[str, str]) -> Choice:
        return Choice("eth0", "it holds 10.0.0.5, on 10.0.0.1's network", ("eth0",))

    def links(self) -> Sequence[LinkState]:
        return []


def torchrun_env(rank: int, local_rank: int | None = None, **extra: str) -> dict[str, str]:
    """Rank ``rank`` of 8, four on each of two nodes, as torchrun starts it."""
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": "8",
        "LOCAL_RANK": str(rank % 4 if local_rank is None else local_rank),
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": str(rank // 4),
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "OMP_NUM_THREADS": "2",
    }
    env.update(extra)
    return env


def doctor(env: Mapping[str, str], *, as_json: bool = False) -> tuple[int, str]:
    out = io.StringIO()
    code = run_doctor(
        timeout=1.0,
        as_json=as_json,
        out=out,
        env=env,
        facts=CPU_HOST,
        network=ReachableNetwork(),
        host="gpu-a",
    )
    return code, out.getvalue()


@pytest.mark.parametrize("rank", [0, 4])
def test_each_nodes_local_rank_0_prints_the_report_and_says_which_node(rank: int) -> None:
    code, text = doctor(torchrun_env(rank))

    assert code == 0
    assert text.startswith(f"agang doctor on gpu-a (node {rank // 4}), rank {rank} of 8:")
    assert "the report for the 4 ranks on this node;" in " ".join(text.split())
    assert text.endswith("No problems found.\n")


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
@pytest.mark.parametrize("rank", [1, 2, 3, 5, 7])
def test_the_other_ranks_print_nothing_when_all_is_well(rank: int, as_json: bool) -> None:
    assert doctor(torchrun_env(rank), as_json=as_json) == (0, "")


def test_a_problem_every_rank_shares_is_printed_once_but_fails_every_rank() -> None:
    shared = {"MASTER_PORT": "x"}  # the same on every rank: local rank 0 reports it

    code, text = doctor(torchrun_env(0, **shared))
    assert code == 1
    assert "`MASTER_PORT` must be an integer" in text

    assert doctor(torchrun_env(1, **shared)) == (1, "")


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_a_problem_of_a_ranks_own_is_printed_by_it(as_json: bool) -> None:
    env = torchrun_env(2, RANK="9")  # its own variable: RANK is not below WORLD_SIZE

    code, text = doctor(env, as_json=as_json)

    assert code == 1
    if as_json:
        document = json.loads(text)
        assert document["problems"] == 1
        assert [f["check"] for f in document["findings"]] == ["world"]
    else:
        assert text.startswith("agang doctor on gpu-a (node 0), local rank 2: its own problems.")
        assert "`RANK` must be less than `WORLD_SIZE` (8), but is 9" in text
        assert "launcher" not in text  # nothing the node's report says already


def test_a_rank_that_cannot_say_its_local_rank_prints_the_whole_report() -> None:
    code, text = doctor(torchrun_env(2, LOCAL_RANK="two"))

    assert code == 1
    assert "`LOCAL_RANK` must be an integer" in text
    assert "ok       launcher:" in text


@pytest.mark.parametrize(
    ("env", "header"),
    [
        ({}, ""),
        ({"RANK": "0", "WORLD_SIZE": "1"}, ""),
        (
            {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"},
            "agang doctor on gpu-a, rank 1 of 2: the report for this node, its one rank.\n",
        ),
        (
            {"RANK": "1", "WORLD_SIZE": "2"},
            "agang doctor on gpu-a, rank 1 of 2: this rank's report.\n",
        ),
    ],
    ids=["no-launcher", "world-of-1", "one-rank-per-node", "ranks-per-node-unknown"],
)
def test_a_process_alone_on_its_node_prints_the_whole_report(
    env: dict[str, str], header: str
) -> None:
    if env:
        env = {**env, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}

    code, text = doctor(env)

    assert code == 0
    assert text.startswith(f"{header}ok       launcher:")
    assert text.endswith("No problems found.\n")


def command_env() -> dict[str, str]:
    prefixes = ("SLURM_", "TORCHELASTIC_", "TORCH_NCCL_", "OMP_NUM_THREADS")
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in os.environ.items() if k not in names and not k.startswith(prefixes)}


@pytest.mark.slow  # four ranks under torchrun
def test_under_torchrun_four_ranks_print_one_report() -> None:
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4"]
    argv += [f"--master-port={free_port()}", "-m", "agang", "doctor"]

    result = subprocess.run(
        argv, env=command_env(), capture_output=True, text=True, timeout=120, check=False
    )

    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert sum(line.startswith("agang doctor on ") for line in lines) == 1, result.stdout
    assert sum(line.startswith("ok       launcher:") for line in lines) == 1, result.stdout
    assert lines[-1] == "No problems found.", result.stdout  # OMP_NUM_THREADS=1: no warning
    assert len(lines) < 40, result.stdout
