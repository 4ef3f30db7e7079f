"""agang.ray on a real local Ray cluster: gangs of actors, deaths told by Ray, a
restarted actor rejoining, the store actor's lifetime, and a weights channel of actors.

One cluster serves the module (``cluster``), pinned to this machine: ``ray.init`` with
4 logical CPUs, no dashboard, its actors on ``num_cpus=0``; the store listens on
127.0.0.1. Ray writes ``/tmp/ray`` and a token under ``~/.ray``: the fixture removes
what it created, and nothing that was there before. Every actor a test starts is
killed at its end. Ray's driver calls are blocking, so these tests are plain functions:
agang's side runs on each actor's event loop (Ray's asyncio).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray", reason="Ray (the extra agang[ray]) is not installed")

import agang  # noqa: E402
import agang.ray as ar  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = ROOT / "tests" / "support"
pytestmark = [pytest.mark.gloo, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """One local Ray cluster for the module; yields its address (for child drivers)."""
    made = [path for path in (Path("/tmp/ray"), Path.home() / ".ray") if not path.exists()]
    # Ray's workers import the test actors by name (``rayactors``).
    paths = [str(ROOT), str(SUPPORT), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    context = ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        namespace=f"agang-tests-{os.getpid()}",
    )
    try:
        yield str(context.address_info["gcs_address"])
    finally:
        ray.shutdown()
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def actors(cluster: str) -> Iterator[list[Any]]:
    """The actors a test starts (append them); each is killed at the test's end."""
    started: list[Any] = []
    yield started
    for actor in started:
        ray.kill(actor, no_restart=True)


@pytest.fixture(scope="module")
def store(cluster: str) -> str:
    return ar.store(host="127.0.0.1")


def members(actors: list[Any], count: int, prefix: str, **options: Any) -> list[Any]:
    from rayactors import GangMember

    made = [
        ray.remote(GangMember).options(name=f"{prefix}{i}", num_cpus=0, **options).remote()
        for i in range(count)
    ]
    actors.extend(made)
    return made


def when_up(call: Any, seconds: float = 60.0) -> Any:
    """``call()``'s result, once the actor Ray restarts answers (``ActorUnavailableError``
    until then)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return ray.get(call(), timeout=seconds)
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def kill_inside_an_all_reduce(gang: list[Any], victim: int) -> tuple[int, float, list[Any]]:
    """SIGKILLs ``gang[victim]`` while the others wait inside an all-reduce for it; its
    pid, when it was killed (``time.time()``), and the others' outcomes."""
    pid = ray.get(gang[victim].pid.remote())
    pending = [actor.all_reduce.remote(1) for i, actor in enumerate(gang) if i != victim]
    time.sleep(0.5)  # the others wait inside the all-reduce for the victim
    killed = time.time()
    os.kill(pid, signal.SIGKILL)
    return pid, killed, ray.get(pending, timeout=30)


def test_a_gang_of_three_actors_is_exact_and_takes_no_default_group(
    actors: list[Any], store: str
) -> None:
    gang = members(actors, 3, "exact-")
    spec = ar.plan(gang, store=store, name="exact", timeout=60)
    joined = ray.get([actor.join.remote(spec) for actor in gang])
    assert [j["rank"] for j in joined] == [0, 1, 2]
    assert {j["size"] for j in joined} == {3}
    assert not any(j["default_group"] for j in joined)  # the actors' own c10d world is free
    results = ray.get([actor.all_reduce.remote(rank + 1) for rank, actor in enumerate(gang)])
    assert [r["result"] for r in results] == [[6.0] * 4] * 3


def test_a_killed_member_fails_every_survivor_at_once_with_rays_cause(
    actors: list[Any], store: str
) -> None:
    gang = members(actors, 3, "killed-")
    spec = ar.plan(gang, store=store, name="killed", timeout=60, op_timeout=60)
    ray.get([actor.join.remote(spec) for actor in gang])
    pid, killed, outcomes = kill_inside_an_all_reduce(gang, 1)
    for outcome in outcomes:
        message = outcome["message"]
        # Every survivor, rank 0 and rank 2 alike, is told who died and Ray's why.
        for words in ("rank 1", f"pid {pid}", "actor 'killed-1'", "Ray: ActorDiedError"):
            assert words in message, message
        # Told at once: far below the op's 60 s deadline (the bench measures it).
        assert outcome["at"] - killed < 6.0, outcome


def test_a_stopped_member_is_blamed_at_the_deadline(actors: list[Any], store: str) -> None:
    gang = members(actors, 3, "stopped-")
    spec = ar.plan(gang, store=store, name="stopped", timeout=60, op_timeout=2.0)
    ray.get([actor.join.remote(spec) for actor in gang])
    pid = ray.get(gang[2].pid.remote())
    os.kill(pid, signal.SIGSTOP)  # Ray sees no death: the deadline must hold
    try:
        started = time.time()
        outcomes = ray.get([gang[0].all_reduce.remote(1), gang[1].all_reduce.remote(1)])
        for outcome in outcomes:
            assert "rank 2" in outcome["message"], outcome
            assert "no answer" in outcome["message"], outcome
            assert 1.5 < outcome["at"] - started < 20.0, outcome
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_restarted_actor_rejoins_its_elastic_gang(actors: list[Any], store: str) -> None:
    gang = members(actors, 3, "elastic-", max_restarts=1)
    spec = ar.plan(
        gang, store=store, name="elastic", timeout=60, op_timeout=30, elastic=agang.Elastic(2)
    )
    ray.get([actor.join.remote(spec) for actor in gang])
    pid, _, outcomes = kill_inside_an_all_reduce(gang, 2)
    assert all("error" in o for o in outcomes)
    reformed = ray.get([gang[0].reform.remote(), gang[1].reform.remote()], timeout=60)
    assert [(r["rank"], r["size"], r["epoch"]) for r in reformed] == [(0, 2, 1), (1, 2, 1)]
    # Ray restarts it (same handle, new pid); it joins again, and the next reform admits it.
    when_up(gang[2].pid.remote)
    joining = gang[2].join.remote(spec)
    deadline = time.monotonic() + 60
    while not ray.get(gang[0].waiting.remote()) and time.monotonic() < deadline:
        time.sleep(0.1)
    reformed = ray.get([gang[0].reform.remote(), gang[1].reform.remote()], timeout=60)
    joined = ray.get(joining, timeout=60)
    assert joined["pid"] != pid
    assert (joined["rank"], joined["size"]) == (2, 3)
    results = ray.get([actor.all_reduce.remote(1) for actor in gang], timeout=60)
    assert [r["result"] for r in results] == [[3.0] * 4] * 3


def test_a_fixed_gang_reforms_with_its_restarted_actor_and_no_one_else(
    actors: list[Any], store: str
) -> None:
    gang = members(actors, 3, "fixed-", max_restarts=1)
    spec = ar.plan(gang, store=store, name="fixed", timeout=60, op_timeout=30)
    ray.get([actor.join.remote(spec) for actor in gang])
    pid, _, outcomes = kill_inside_an_all_reduce(gang, 1)
    assert all("error" in o for o in outcomes)
    # The survivors' reform waits for all 3: Ray's restarted incarnation joins it.
    reforming = [gang[0].reform.remote(), gang[2].reform.remote()]
    when_up(gang[1].pid.remote)
    joined = ray.get(gang[1].join.remote(spec), timeout=60)
    reformed = ray.get(reforming, timeout=60)
    assert joined["pid"] != pid
    assert sorted((r["rank"], r["size"]) for r in [*reformed, joined]) == [(0, 3), (1, 3), (2, 3)]
    results = ray.get([actor.all_reduce.remote(1) for actor in gang], timeout=60)
    assert [r["result"] for r in results] == [[3.0] * 4] * 3


def test_the_store_actor_ends_with_its_driver(cluster: str) -> None:
    namespace = f"agang-child-{os.getpid()}"
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "import ray, agang.ray as ar; "
            f"ray.init(address={cluster!r}, namespace={namespace!r}, log_to_driver=False); "
            "print(ar.store(host='127.0.0.1'), flush=True)",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.environ["PYTHONPATH"]},
        check=True,
    )
    address = child.stdout.split()[-1]
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # Ray ends the driver's actors moments after it
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
        except OSError:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the store at {address} outlived its driver")
    with pytest.raises(ValueError, match="agang-store"):
        ray.get_actor("agang-store", namespace=namespace)


def test_two_gangs_and_a_channel_in_one_job(actors: list[Any], store: str) -> None:
    first, second = members(actors, 2, "first-"), members(actors, 2, "second-")
    servers = members(actors, 2, "server-", max_restarts=1)
    specs = [ar.plan(g, store=store, name=n) for g, n in ((first, "one"), (second, "two"))]
    ray.get([a.join.remote(specs[0]) for a in first] + [a.join.remote(specs[1]) for a in second])
    results = ray.get([a.all_reduce.remote(1) for a in first + second])
    assert [r["result"] for r in results] == [[2.0] * 4] * 4
    weights = {"w": torch.zeros(8)}
    publisher = agang.WeightPublisher.open_sync(weights, store=store, channel="policy")
    try:
        names = ray.get([s.subscribe.remote(store, "policy") for s in servers])
        assert names == ["server-0", "server-1"]  # named after the actors
        weights["w"].fill_(1.0)
        report = publisher.push_sync(1)
        assert sorted(report.delivered) == names
        assert [r["w"] for r in ray.get([s.receive.remote() for s in servers])] == [[1.0] * 8] * 2
        filed = len(ray.get(ray.get_actor("agang-store").filed.remote()))
        os.kill(ray.get(servers[1].pid.remote()), signal.SIGKILL)
        # A restartable actor's death is Ray's word once its restart begins (about 1-2 s
        # here, not milliseconds): the push that follows it drops the server with it.
        deadline = time.monotonic() + 30
        while len(ray.get(ray.get_actor("agang-store").filed.remote())) == filed:
            assert time.monotonic() < deadline, "Ray's watcher filed no notice"
            time.sleep(0.05)
        weights["w"].fill_(2.0)
        report = publisher.push_sync(2)
        assert report.delivered == ("server-0",)
        assert "Ray:" in report.dropped["server-1"], report.dropped
        # Ray restarts it under its name; it subscribes again and is admitted at the next push.
        assert when_up(lambda: servers[1].subscribe.remote(store, "policy")) == "server-1"
        weights["w"].fill_(3.0)
        report = publisher.push_sync(3)
        assert sorted(report.delivered) == names
        assert ray.get(servers[1].receive.remote(), timeout=60) == {"version": 3, "w": [3.0] * 8}
    finally:
        publisher.close_sync()


def test_the_ray_rl_loop_example_passes_its_checks(cluster: str) -> None:
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        "RAY_ADDRESS": cluster,  # the example's driver joins this cluster
    }
    child = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "ray_rl_loop.py")],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-4000:]
    assert "all checks passed" in child.stdout, child.stdout[-4000:]


def test_bench_ray_times_a_killed_actor_with_and_without_rays_notices(
    cluster: str, tmp_path: Path
) -> None:
    # One repetition, on the module's cluster (one cluster at a time on this machine).
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": cluster}
    child = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_ray.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=170,
        env=env,
    )
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-4000:]
    for row in ("| fixed gang |", "| elastic recovery |", "| weights push |", "Goal: every"):
        assert row in child.stdout, child.stdout
    runs = json.loads((tmp_path / "ray.json").read_text())["runs"]
    assert len(runs) == 6
    # Ray's cause is named exactly where the actors mix in agang.ray.Member.
    assert all(run["ray_cause"] == (run["mode"] == "with notices") for run in runs), runs
    assert all(size == [2, 1] for run in runs for size in run.get("new_gang", [])), runs
