"""``agang doctor``: the pure core on plain data, then the real probes on loopback only.

Every network call here is bounded (the probe's timeout) and goes to 127.0.0.1 only.
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import pytest
from doctor_hosts import CPU_HOST
from netutil import free_port

from agang.__main__ import main
from agang._cli.doctor.diagnose import diagnose
from agang._cli.doctor.findings import Finding, Status, has_problems, render, render_json
from agang._cli.doctor.host import HostFacts, probe_host_facts
from agang._cli.doctor.links import LinkState
from agang._cli.doctor.network import SocketProbe
from agang._setup.env import world_from_env
from agang._setup.interface import Choice

GPU_HOST = HostFacts(
    torch_version="2.11.0+cu128",
    distributed_available=True,
    gloo_available=True,
    nccl_available=True,
    cuda_available=True,
    cuda_device_count=2,
    cuda_version="12.8",
    nccl_version="2.27.3",
    num_cpus=32,
)


@dataclass
class FakeNetwork:
    """A network probe from plain data: known names, and the error each call raises."""

    names: dict[str, list[str]] = field(default_factory=lambda: {"127.0.0.1": ["127.0.0.1"]})
    bind_error: OSError | None = None
    connect_error: OSError | None = None
    choice: Choice = field(default_factory=lambda: Choice("lo", "it holds 127.0.0.1"))
    link_states: list[LinkState] = field(default_factory=list)
    calls: list[tuple[str, str, int]] = field(default_factory=list)

    def resolve(self, host: str) -> Sequence[str]:
        self.calls.append(("resolve", host, 0))
        if host not in self.names:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return self.names[host]

    def bind(self, address: str, port: int) -> None:
        self.calls.append(("bind", address, port))
        if self.bind_error is not None:
            raise self.bind_error

    def connect(self, address: str, port: int) -> None:
        self.calls.append(("connect", address, port))
        if self.connect_error is not None:
            raise self.connect_error

    def interface(self, host: str, env: Mapping[str, str]) -> Choice:
        return self.choice

    def links(self) -> Sequence[LinkState]:
        return self.link_states


def torchrun_env(rank: int = 0, world_size: int = 2, **extra: str) -> dict[str, str]:
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "OMP_NUM_THREADS": "1",
    }
    env.update(extra)
    return env


def run(
    env: Mapping[str, str],
    network: FakeNetwork | None = None,
    facts: HostFacts = CPU_HOST,
) -> list[Finding]:
    return diagnose(env, facts, network if network is not None else FakeNetwork())


def only(findings: Sequence[Finding], check: str, status: Status | None = None) -> Finding:
    """The one finding of ``check`` (with ``status``, if given)."""
    matches = [f for f in findings if f.check == check and status in (None, f.status)]
    assert len(matches) == 1, findings
    return matches[0]


def problems(findings: Sequence[Finding]) -> list[Finding]:
    return [f for f in findings if f.status is Status.PROBLEM]


# Launcher variables.


def test_no_launcher_variables_mean_an_in_process_gang_and_no_network() -> None:
    network = FakeNetwork()

    findings = run({}, network)

    assert "in-process gang" in only(findings, "launcher", Status.OK).seen
    assert not problems(findings)
    assert network.calls == []


def test_a_valid_torchrun_env_on_rank_0_with_a_free_port_is_fine() -> None:
    network = FakeNetwork()

    findings = run(torchrun_env(rank=0), network)

    assert not has_problems(findings), findings
    assert all(f.status is Status.OK for f in findings), findings
    assert "Rank 0 of 2" in only(findings, "world").seen
    assert network.calls == [("resolve", "127.0.0.1", 0), ("bind", "127.0.0.1", 29500)]


def test_a_world_of_one_uses_no_network() -> None:
    network = FakeNetwork()

    findings = run({"RANK": "0", "WORLD_SIZE": "1"}, network)

    assert "in-process gang" in only(findings, "world").seen
    assert network.calls == []


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "0"}, "`WORLD_SIZE` must be set when `RANK` is"),
        ({"WORLD_SIZE": "2"}, "`RANK` must be set when `WORLD_SIZE` is"),
        ({"RANK": "zero", "WORLD_SIZE": "2"}, "`RANK` must be an integer, but is 'zero'"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "`RANK` must be less than `WORLD_SIZE` (2)"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}, "`MASTER_ADDR` must be set"),
        (torchrun_env(MASTER_PORT="70000"), "`MASTER_PORT` must be at most 65535"),
    ],
)
def test_invalid_launcher_values_are_problems_with_a_fix(env: dict[str, str], message: str) -> None:
    network = FakeNetwork()

    findings = run(env, network)

    problem = only(findings, "world", Status.PROBLEM)
    assert message in problem.seen
    assert problem.fix
    assert network.calls == []  # no world, nothing to probe


def test_the_fix_follows_the_variable_the_error_names() -> None:
    port = only(run(torchrun_env(MASTER_PORT="x")), "world", Status.PROBLEM)
    rank = only(run({"RANK": "5", "WORLD_SIZE": "2"}), "world", Status.PROBLEM)

    assert "MASTER_PORT to a free port" in port.fix
    assert "torchrun" in rank.fix


def test_master_addr_without_rank_warns_of_an_in_process_gang() -> None:
    finding = only(run({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}), "launcher")

    assert finding.status is Status.WARN
    assert "neither `RANK` nor `WORLD_SIZE`" in finding.seen


def test_local_rank_not_below_local_world_size_is_a_problem() -> None:
    env = torchrun_env(rank=1, world_size=4, LOCAL_RANK="2", LOCAL_WORLD_SIZE="2")

    problem = only(run(env), "world", Status.PROBLEM)

    assert "`LOCAL_RANK` must be less than `LOCAL_WORLD_SIZE` (2), but is 2" in problem.seen
    assert "--nproc-per-node" in problem.fix


def test_omp_num_threads_unset_with_several_local_ranks_warns_with_the_share() -> None:
    env = torchrun_env(world_size=4)
    del env["OMP_NUM_THREADS"]

    warning = only(run(env), "threads", Status.WARN)

    assert "unset with 4 ranks on this node" in warning.seen
    assert "8 CPUs // 4 ranks = 2" in warning.fix


@pytest.mark.parametrize(
    ("threads", "status"),
    [("2", Status.OK), ("3", Status.WARN), ("0", Status.PROBLEM), ("many", Status.PROBLEM)],
)
def test_omp_num_threads_is_judged_against_the_per_rank_share(threads: str, status: Status) -> None:
    env = torchrun_env(world_size=4, OMP_NUM_THREADS=threads)  # 8 CPUs, 4 ranks: share 2

    assert only(run(env), "threads").status is status


@pytest.mark.parametrize("num_cpus", [2, 4, 8])
def test_one_thread_per_rank_is_never_told_to_be_one(num_cpus: int) -> None:
    # torchrun sets OMP_NUM_THREADS=1: with more ranks than CPUs there is no smaller share.
    env = torchrun_env(world_size=4, OMP_NUM_THREADS="1")
    facts = dataclasses.replace(CPU_HOST, num_cpus=num_cpus)

    finding = only(run(env, facts=facts), "threads", Status.OK)

    assert finding.seen.startswith("OMP_NUM_THREADS=1 per rank")
    assert not finding.fix


def test_more_threads_than_the_share_with_more_ranks_than_cpus_warns_to_set_1() -> None:
    env = torchrun_env(world_size=4, OMP_NUM_THREADS="2")
    facts = dataclasses.replace(CPU_HOST, num_cpus=2)

    warning = only(run(env, facts=facts), "threads", Status.WARN)

    assert "asks for 8 compute threads on 2 CPUs" in warning.seen
    assert "(2 CPUs // 4 ranks = 1)" in warning.fix


def slurm_env(procid: int = 1, num_tasks: int = 8, **extra: str) -> dict[str, str]:
    env = {
        "SLURM_PROCID": str(procid),
        "SLURM_NTASKS": str(num_tasks),
        "SLURM_LOCALID": str(procid % 4),
        "SLURM_NTASKS_PER_NODE": "4",
        "SLURM_JOB_NODELIST": "node[001-002]",
        "SLURM_JOB_ID": "1234",
        "OMP_NUM_THREADS": "2",
    }
    env.update(extra)
    return env


def test_a_valid_slurm_env_is_checked_like_torchrun_s() -> None:
    network = FakeNetwork(names={"node001": ["10.0.0.1"]})

    findings = run(slurm_env(procid=5), network)

    assert not problems(findings), findings
    assert "SLURM's variables" in only(findings, "launcher").seen
    world = only(findings, "world").seen
    assert "Rank 5 of 8 (local rank 1, from slurm)" in world
    assert "port derived from SLURM_JOB_ID" in world
    assert "first host of SLURM_JOB_NODELIST" in only(findings, "MASTER_ADDR").seen
    assert network.calls == [("resolve", "node001", 0), ("connect", "10.0.0.1", 11234)]


def test_a_single_slurm_task_is_an_in_process_gang() -> None:
    network = FakeNetwork()

    findings = run({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "1"}, network)

    assert not problems(findings), findings
    assert network.calls == []


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (slurm_env(procid=8), "`SLURM_PROCID` must be less than `SLURM_NTASKS` (8)"),
        (slurm_env(SLURM_JOB_ID="x"), "`SLURM_JOB_ID` must be an integer"),
        ({"SLURM_NTASKS": "4", "SLURM_JOB_ID": "1"}, "`SLURM_PROCID` must be set"),
    ],
)
def test_invalid_slurm_values_are_problems_with_a_fix(env: dict[str, str], message: str) -> None:
    problem = only(run(env), "world", Status.PROBLEM)

    assert message in problem.seen
    assert "srun" in problem.fix


# Each launcher's pieces, valid on their own, mixed every way: a world of 2 under torchrun
# (with its store), none, or MASTER_* alone; SLURM's two markers, each or both, beside the
# job's other variables.
_TORCHRUN_PIECES = {
    "no torchrun": {},
    "MASTER_* only": {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
    "torchrun": {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    },
}
_SLURM_PIECES = {
    "no SLURM markers": {},
    "SLURM_PROCID only": {"SLURM_PROCID": "0"},
    "SLURM_NTASKS only": {"SLURM_NTASKS": "2"},
    "both SLURM markers": {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"},
}
_SLURM_JOB = {"SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": "node001", "OMP_NUM_THREADS": "1"}
#: How the doctor's launcher finding begins when it names a launcher (the source).
_NAMED = {"torchrun": "torchrun's variables", "slurm": "SLURM's variables"}


@pytest.mark.parametrize("slurm", list(_SLURM_PIECES))
@pytest.mark.parametrize("torchrun", list(_TORCHRUN_PIECES))
def test_the_doctor_names_the_launcher_init_reads_the_world_from(torchrun: str, slurm: str) -> None:
    # agang.init reads the world with world_from_env; the doctor must see the same
    # launcher, or none where init sees none (once, a lone SLURM_NTASKS was SLURM's to
    # the doctor and no launcher to init).
    env = {**_TORCHRUN_PIECES[torchrun], **_SLURM_PIECES[slurm], **_SLURM_JOB}
    world = world_from_env(env, expand_hostnames=lambda nodelist: [nodelist])

    seen = only(run(env, FakeNetwork(names={"node001": ["10.0.0.1"]})), "launcher").seen

    named = {
        source for source, start in _NAMED.items() if seen.startswith((f"{start}:", f"{start} ("))
    }
    assert named == ({world.source} if world is not None else set()), seen
    if world is None:
        assert "in-process gang" in seen


def test_torchrun_variables_take_precedence_over_slurm() -> None:
    env = torchrun_env(SLURM_PROCID="3", SLURM_NTASKS="8", SLURM_JOB_ID="1234")

    findings = run(env)

    assert "take precedence over SLURM's" in only(findings, "launcher").seen
    assert "from torchrun" in only(findings, "world").seen


def test_a_taken_derived_port_is_only_a_warning() -> None:
    # agang chose that port itself (from the job id) and may move off it.
    network = FakeNetwork(
        names={"node001": ["10.0.0.1"]},
        bind_error=OSError(errno.EADDRINUSE, "Address already in use"),
    )

    finding = only(run(slurm_env(procid=0), network), "MASTER_PORT")

    assert finding.status is Status.WARN
    assert "derived from SLURM_JOB_ID" in finding.seen


# Backends.


def test_a_cpu_build_is_fine_and_says_agang_uses_gloo() -> None:
    findings = run({})

    assert "CPU-only build" in only(findings, "torch").seen
    assert "agang uses Gloo" in only(findings, "cuda").seen
    assert only(findings, "TORCH_NCCL_ASYNC_ERROR_HANDLING").status is Status.OK


def test_no_torch_distributed_is_a_problem() -> None:
    facts = HostFacts("2.13.0", False, False, False, False, 0, None, None, 2)

    problem = only(run({}, facts=facts), "torch.distributed", Status.PROBLEM)

    assert "`torch.distributed.is_available()` must be True, but is False instead." in problem.seen


def test_cuda_without_nccl_is_a_problem() -> None:
    facts = HostFacts("2.13.0", True, True, False, True, 1, "12.8", None, 8)

    assert only(run({}, facts=facts), "nccl").status is Status.PROBLEM


def test_more_local_ranks_than_gpus_is_a_problem() -> None:
    env = torchrun_env(world_size=4)

    problem = only(run(env, facts=GPU_HOST), "local ranks", Status.PROBLEM)

    assert "4 ranks on this node share 2 CUDA device(s)" in problem.seen
    assert "--nproc-per-node=2" in problem.fix


@pytest.mark.parametrize(
    ("value", "status"),
    [
        (None, Status.WARN),
        ("3", Status.WARN),
        ("1", Status.WARN),
        ("2", Status.OK),
        ("0", Status.OK),
        ("yes", Status.PROBLEM),
    ],
)
def test_nccl_async_error_handling_is_explained(value: str | None, status: Status) -> None:
    env = {} if value is None else {"TORCH_NCCL_ASYNC_ERROR_HANDLING": value}

    finding = only(run(env, facts=GPU_HOST), "TORCH_NCCL_ASYNC_ERROR_HANDLING")

    assert finding.status is status
    assert "NCCL 2.27.3" in only(run(env, facts=GPU_HOST), "nccl").seen


def test_a_bad_nccl_setting_is_only_a_warning_where_nccl_is_not_used() -> None:
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "yes"}

    assert only(run(env), "TORCH_NCCL_ASYNC_ERROR_HANDLING").status is Status.WARN


# Network, with a fake probe.


def test_a_taken_port_on_rank_0_is_a_problem_with_causes_and_a_fix() -> None:
    network = FakeNetwork(bind_error=OSError(errno.EADDRINUSE, "Address already in use"))

    problem = only(run(torchrun_env(rank=0), network), "MASTER_PORT", Status.PROBLEM)

    assert "port 29500 is taken by another process" in problem.seen
    assert problem.causes
    assert "Pick another port" in problem.fix


def test_an_address_of_another_host_on_rank_0_is_a_problem() -> None:
    network = FakeNetwork(
        names={"10.9.9.9": ["10.9.9.9"]},
        bind_error=OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address"),
    )
    env = torchrun_env(rank=0, MASTER_ADDR="10.9.9.9")

    problem = only(run(env, network), "MASTER_ADDR", Status.PROBLEM)

    assert "is not an address of this host" in problem.seen


def test_an_unresolvable_address_is_a_problem_and_skips_the_port() -> None:
    network = FakeNetwork(names={})
    env = torchrun_env(rank=1, MASTER_ADDR="no-such-host.invalid")

    findings = run(env, network)

    problem = only(findings, "MASTER_ADDR", Status.PROBLEM)
    assert "'no-such-host.invalid' does not resolve" in problem.seen
    assert "getent hosts" in problem.fix
    assert [call[0] for call in network.calls] == ["resolve"]
    assert not [f for f in findings if f.check == "MASTER_PORT"]


def test_a_reachable_port_on_another_rank_is_fine() -> None:
    network = FakeNetwork()

    findings = run(torchrun_env(rank=1), network)

    assert "is reachable" in only(findings, "MASTER_PORT", Status.OK).seen
    assert ("connect", "127.0.0.1", 29500) in network.calls


@pytest.mark.parametrize(
    ("error", "seen", "cause"),
    [
        (ConnectionRefusedError(errno.ECONNREFUSED, "refused"), "refused", "not started"),
        (TimeoutError("timed out"), "No answer", "firewall"),
        (OSError(errno.EHOSTUNREACH, "No route to host"), "No route to host", "no route"),
    ],
)
def test_an_unreachable_port_on_another_rank_names_the_likely_causes(
    error: OSError, seen: str, cause: str
) -> None:
    network = FakeNetwork(connect_error=error)

    problem = only(run(torchrun_env(rank=1), network), "MASTER_PORT", Status.PROBLEM)

    assert seen in problem.seen
    assert any(cause in c for c in problem.causes), problem.causes
    assert problem.fix


def test_the_agent_store_is_connected_to_even_from_rank_0() -> None:
    network = FakeNetwork()

    run(torchrun_env(rank=0, TORCHELASTIC_USE_AGENT_STORE="True"), network)

    assert [call[0] for call in network.calls] == ["resolve", "connect"]


def test_port_0_is_a_problem_for_a_larger_world() -> None:
    problem = only(run(torchrun_env(MASTER_PORT="0")), "MASTER_PORT", Status.PROBLEM)

    assert "must be a fixed port for a world of 2, but is 0 instead" in problem.seen


def test_a_loopback_address_for_a_multi_node_world_is_a_problem() -> None:
    env = torchrun_env(rank=1, world_size=4, LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")

    problem = only(run(env), "MASTER_ADDR", Status.PROBLEM)

    assert "but is the loopback address '127.0.0.1' instead" in problem.seen


# Rendering.


def test_render_shows_status_causes_fix_and_a_summary() -> None:
    network = FakeNetwork(connect_error=ConnectionRefusedError(errno.ECONNREFUSED, "refused"))
    findings = run(torchrun_env(rank=1, OMP_NUM_THREADS="16"), network)

    text = render(findings)

    assert "PROBLEM  MASTER_PORT: Connection to 127.0.0.1:29500 refused" in text
    assert "warn     threads:" in text
    assert "likely causes:\n         - rank 0 has not started yet" in text
    assert "fix: Start rank 0" in text
    assert text.endswith("Found 1 problem and 1 warning.\n")
    assert all(len(line) <= 100 for line in text.splitlines())


def test_render_json_round_trips() -> None:
    findings = run({"RANK": "3", "WORLD_SIZE": "2"})

    document = json.loads(render_json(findings))

    assert document["problems"] == 1
    assert {"check": "world", "status": "problem"}.items() <= document["findings"][1].items()


# The real probes, on loopback only.

REAL_TIMEOUT = 1.0


@pytest.fixture
def listening_port() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def real_run(env: Mapping[str, str]) -> list[Finding]:
    return diagnose(env, CPU_HOST, SocketProbe(timeout=REAL_TIMEOUT))


def test_a_port_bound_here_is_taken_on_rank_0(listening_port: int) -> None:
    findings = real_run(torchrun_env(rank=0, MASTER_PORT=str(listening_port)))

    assert "is taken by another process" in only(findings, "MASTER_PORT", Status.PROBLEM).seen


def test_a_free_port_is_free_on_rank_0() -> None:
    findings = real_run(torchrun_env(rank=0, MASTER_PORT=str(free_port())))

    assert "is free on 127.0.0.1" in only(findings, "MASTER_PORT", Status.OK).seen


def test_a_listening_port_is_reachable_from_rank_1(listening_port: int) -> None:
    findings = real_run(torchrun_env(rank=1, MASTER_PORT=str(listening_port)))

    assert "is reachable" in only(findings, "MASTER_PORT", Status.OK).seen


def test_a_closed_port_is_refused_on_rank_1() -> None:
    findings = real_run(torchrun_env(rank=1, MASTER_PORT=str(free_port())))

    assert "refused" in only(findings, "MASTER_PORT", Status.PROBLEM).seen


def test_a_slow_resolver_is_cut_off_at_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    def slow_getaddrinfo(*args: object, **kwargs: object) -> list[object]:
        time.sleep(5)
        return []

    monkeypatch.setattr(socket, "getaddrinfo", slow_getaddrinfo)
    started = time.monotonic()

    with pytest.raises(TimeoutError, match="no answer from the resolver"):
        SocketProbe(timeout=0.2).resolve("store.example")
    assert time.monotonic() - started < 2


@pytest.mark.parametrize(
    "address", ["10.201.0.1", "127.0.0.1", "::1", "fe80::1", "::ffff:10.0.0.1", "fe80::1%lo"]
)
def test_an_ip_address_resolves_to_itself_without_the_resolver(
    monkeypatch: pytest.MonkeyPatch, address: str
) -> None:
    """No resolver is asked, so a loaded machine's slow thread cannot time it out (CI
    once failed an IP address at ``--timeout 0.5`` so)."""

    def no_resolver(*args: object, **kwargs: object) -> list[object]:
        raise AssertionError("the resolver was asked")

    monkeypatch.setattr(socket, "getaddrinfo", no_resolver)

    assert SocketProbe(timeout=1e-9).resolve(address) == [address]


def test_the_real_host_facts_match_torch() -> None:
    import torch

    facts = probe_host_facts()

    assert facts.torch_version == torch.__version__
    assert facts.cuda_available == torch.cuda.is_available()


# The command.


def command_env(**variables: str) -> dict[str, str]:
    """This process's environment without launcher variables, plus ``variables``."""
    prefixes = ("SLURM_", "TORCHELASTIC_", "TORCH_NCCL_", "OMP_NUM_THREADS")
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in names and not k.startswith(prefixes)}
    env.update(variables)
    return env


def agang_command(*arguments: str, env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agang", *arguments],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.slow  # runs the command in a process of its own
def test_the_command_reports_a_taken_port_and_exits_1(listening_port: int) -> None:
    env = command_env(**torchrun_env(rank=0, MASTER_PORT=str(listening_port)))

    result = agang_command("doctor", env=env)

    assert result.returncode == 1, result.stderr
    assert "PROBLEM  MASTER_PORT:" in result.stdout
    assert f"port {listening_port} is taken" in " ".join(result.stdout.split())  # unwrapped
    assert "Found 1 problem." in result.stdout


@pytest.mark.slow  # runs the command in a process of its own
def test_the_command_exits_0_without_a_launcher_and_speaks_json() -> None:
    result = agang_command("doctor", "--json", env=command_env())

    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["problems"] == 0
    assert document["findings"][0]["check"] == "launcher"


@pytest.mark.parametrize("arguments", [[], ["cure"], ["doctor", "--timeout", "-1"]])
def test_usage_errors_exit_2(arguments: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(arguments)

    assert exit_info.value.code == 2
    assert "usage: agang" in capsys.readouterr().err


# The interface of the ranks' connections (agang._setup.interface).


def test_the_interface_agang_will_use_is_reported() -> None:
    chosen = Choice("eth0", "it holds 10.0.0.5, the address that reaches 10.0.0.1", ("eth0",))
    finding = only(run(torchrun_env(), FakeNetwork(choice=chosen)), "interface", Status.OK)
    assert "agang will use eth0" in finding.seen


def test_several_networks_are_a_warning_naming_them() -> None:
    chosen = Choice("eth0", "it holds 10.0.0.5", ("eth0", "ib0"))
    finding = only(run(torchrun_env(), FakeNetwork(choice=chosen)), "interface", Status.WARN)
    assert "ib0" in finding.seen
    assert "AGANG_SOCKET_IFNAME" in finding.fix


def test_no_interface_found_is_a_warning_and_a_users_choice_is_kept() -> None:
    unknown = Choice(None, "no route from this host to MASTER_ADDR 'x'")
    finding = only(run(torchrun_env(), FakeNetwork(choice=unknown)), "interface", Status.WARN)
    assert "cannot tell" in finding.seen
    env = torchrun_env(GLOO_SOCKET_IFNAME="ib0")
    finding = only(run(env, FakeNetwork(choice=unknown)), "interface", Status.OK)
    assert finding.seen == "Set by you: GLOO_SOCKET_IFNAME=ib0."


# The state of the interface toward MASTER_ADDR (agang._cli.doctor.links); across real
# nodes in tests/gloo/test_doctor_nodes.py.

ETH0_UP = LinkState("eth0", up=True, carrier=True, networks=("10.0.0.5/24",))
ETH0_NO_CARRIER = LinkState("eth0", up=True, carrier=False, networks=("10.0.0.5/24",))
ETH0_DOWN = LinkState("eth0", up=False, carrier=False, networks=("10.0.0.5/24",))
VIA_ETH0 = Choice("eth0", "it holds 10.0.0.5, the address that reaches 10.0.0.1", ("eth0",))


def on_eth0(
    links: list[LinkState], choice: Choice, connect_error: OSError | None = None
) -> FakeNetwork:
    """MASTER_ADDR 10.0.0.1, on eth0's network."""
    names = {"10.0.0.1": ["10.0.0.1"]}
    return FakeNetwork(names=names, connect_error=connect_error, choice=choice, link_states=links)


def test_the_store_port_is_reached_from_the_interface_on_master_addrs_network() -> None:
    findings = run(
        torchrun_env(rank=1, MASTER_ADDR="10.0.0.1"), on_eth0([ETH0_UP], choice=VIA_ETH0)
    )

    assert only(findings, "MASTER_PORT", Status.OK).seen.endswith("is reachable from eth0.")
    assert "agang will use eth0" in only(findings, "interface", Status.OK).seen


def test_an_interface_without_carrier_toward_master_addr_is_a_problem_naming_it() -> None:
    network = on_eth0([ETH0_NO_CARRIER], choice=VIA_ETH0, connect_error=TimeoutError("timed out"))

    findings = run(torchrun_env(rank=1, MASTER_ADDR="10.0.0.1"), network)

    port = only(findings, "MASTER_PORT", Status.PROBLEM)
    assert "from eth0" in port.seen
    assert port.causes[0].startswith("eth0 is up but has no carrier"), port.causes
    interface = only(findings, "interface", Status.PROBLEM)
    assert "eth0, this host's interface toward '10.0.0.1' (10.0.0.5/24), is up but" in (
        interface.seen
    )
    assert "agang would use it" in interface.seen
    assert "unplugged" in interface.causes[0]
    assert "`ip link show eth0`" in interface.fix


def test_a_down_interface_with_no_route_is_named_by_its_network() -> None:
    no_route = Choice(None, "no route from this host to MASTER_ADDR '10.0.0.1'")
    unreachable = OSError(errno.ENETUNREACH, "Network is unreachable")
    network = on_eth0([ETH0_DOWN], choice=no_route, connect_error=unreachable)

    findings = run(torchrun_env(rank=1, MASTER_ADDR="10.0.0.1"), network)

    assert "from eth0" in only(findings, "MASTER_PORT", Status.PROBLEM).seen
    interface = only(findings, "interface", Status.PROBLEM)
    assert interface.seen.startswith("eth0, this host's interface toward '10.0.0.1'")
    assert "is down: there is no route to MASTER_ADDR" in interface.seen
    assert "AGANG_SOCKET_IFNAME" in interface.fix


def test_rank_0_on_a_down_interface_is_told_although_the_port_binds() -> None:
    findings = run(
        torchrun_env(rank=0, MASTER_ADDR="10.0.0.1"), on_eth0([ETH0_DOWN], choice=VIA_ETH0)
    )

    assert only(findings, "MASTER_PORT", Status.OK)
    assert "is down" in only(findings, "interface", Status.PROBLEM).seen


def test_a_name_that_means_loopback_here_is_named_and_the_port_is_not_checked() -> None:
    env = torchrun_env(
        rank=1, world_size=4, LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="node0"
    )
    network = FakeNetwork(names={"node0": ["127.0.1.1"]})

    findings = run(env, network)

    problem = only(findings, "MASTER_ADDR", Status.PROBLEM)
    assert "'node0' resolves to the loopback address 127.0.1.1 on this node" in problem.seen
    assert "2 ranks on this node" in problem.seen
    assert "--local-addr" in problem.fix
    assert [call[0] for call in network.calls] == ["resolve"]
    assert not [f for f in findings if f.check in ("MASTER_PORT", "interface")]


def test_the_real_links_leave_out_loopback_and_carry_their_prefixes() -> None:
    links = SocketProbe().links()

    for link in links:
        networks = [ipaddress.ip_interface(network) for network in link.networks]
        assert not any(network.is_loopback for network in networks), link
        assert all("/" in network for network in link.networks), link
        assert link.up or not link.carrier, link
