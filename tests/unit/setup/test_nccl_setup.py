"""NCCL set-up defects that need no GPU to show: the device index and splitting groups.

- C6: ``init(device="cuda")`` (no index) used to keep the bare device, which every later
  step refuses (``torch.cuda.set_device``, ``init_process_group(device_id=...)``, the
  tensor checks); it now means this rank's GPU, as ``device=None`` does.
- C7: a sub-gang or lane of an NCCL world was always made by ``split_group``, which
  refuses a default group made without ``device_id`` (a world the user set up before
  ``agang.init``); such a world now gets ``new_group``.
- L1: with order checking on, every rank of an NCCL world joined the sub-gang's side
  Gloo group, and c10d split NCCL's world communicator on the non-members alone (they
  hung); now only members make it.
- L2: a c10d-side timeout killed the process minutes later (NCCL's heartbeat monitor);
  init now turns the monitor and the dump signal off unless the user set them, and an op
  without a deadline lifts c10d's timeout out of reach.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import agang
from agang._backends.c10d import children as c10d_children
from agang._setup.process import prepare_process, resolve_device


def _world(local_rank: int) -> agang.WorldInfo:
    return agang.WorldInfo(
        rank=local_rank, world_size=4, local_rank=local_rank, master_addr="h", master_port=1
    )


@pytest.mark.parametrize(("local_rank", "expected"), [(0, 0), (1, 1), (3, 1)])
def test_c6_resolve_device_adds_the_local_index(
    monkeypatch: pytest.MonkeyPatch, local_rank: int, expected: int
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)

    assert resolve_device("cuda", "nccl", _world(local_rank)) == torch.device("cuda", expected)
    assert resolve_device(torch.device("cuda"), None, _world(local_rank)).index == expected
    # An index the user gave is kept, and the automatic choice agrees with the bare one.
    assert resolve_device("cuda:0", "nccl", _world(local_rank)) == torch.device("cuda", 0)
    assert resolve_device(None, None, _world(local_rank)) == torch.device("cuda", expected)


def test_c6_a_bare_cuda_device_without_cuda_is_refused_naming_device() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: this checks the refusal on a machine without it")
    with pytest.raises(ValueError, match="`device`"):
        resolve_device("cuda", "nccl", _world(0))


class _Group:
    """What ``create_groups`` reads of a parent group."""

    def rank(self) -> int:
        return 0


def _record_creation(monkeypatch: pytest.MonkeyPatch, bound_device: Any) -> list[str]:
    calls: list[str] = []

    class Default:
        bound_device_id = bound_device

    def split_group(**kwargs: Any) -> Any:
        if Default.bound_device_id is None:  # what torch 2.13's split_group does
            raise RuntimeError(
                "No device associated with the default pg, not safe to split any process groups"
            )
        calls.append("split_group")
        return "split"

    def new_group(*args: Any, **kwargs: Any) -> Any:
        calls.append(f"new_group({kwargs.get('backend')})")
        return "new"

    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", lambda: Default())
    monkeypatch.setattr(dist, "split_group", split_group, raising=False)
    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank)
    return calls


async def _create(parent: _Group | None = None, *, with_side_group: bool = False) -> Any:
    """Members [0, 1] of an NCCL world, as this rank (``parent``'s) makes them."""
    return await c10d_children.create_groups(
        parent or _Group(),  # type: ignore[arg-type]
        [0, 1],
        kind="nccl",
        is_world=True,
        with_side_group=with_side_group,
        high_priority=False,
        backstop=60.0,
        seconds=10.0,
        parent_name="root",
    )


@pytest.mark.anyio
async def test_c7_create_gang_without_a_bound_device_uses_new_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _record_creation(monkeypatch, bound_device=None)

    group, side = await _create()

    assert (group, side) == ("new", None)
    assert calls == ["new_group(None)"]


@pytest.mark.anyio
async def test_c7_create_gang_with_a_bound_device_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _record_creation(monkeypatch, bound_device=torch.device("cuda", 0))

    group, _ = await _create()

    assert group == "split"
    assert calls == ["split_group"]


# L2: a c10d-side timeout must not kill the process.

_NCCL_KILL_SWITCHES = ("TORCH_NCCL_ENABLE_MONITORING", "TORCH_NCCL_DUMP_ON_TIMEOUT")


def test_l2_init_turns_off_the_heartbeat_monitor_and_the_dump_signal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in (*_NCCL_KILL_SWITCHES, "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")  # the user's choice is kept
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # chosen already: nothing to set
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    prepare_process(_world(0), "nccl", torch.device("cuda", 0), {})

    import os

    assert os.environ["TORCH_NCCL_ENABLE_MONITORING"] == "0"
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"


class _TimedGroup:
    """A group double that records c10d's timeout as agang sets it."""

    group_name = "timed"

    def __init__(self) -> None:
        self.timeouts: list[float] = []

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 2

    def set_timeout(self, timeout: Any) -> None:
        self.timeouts.append(timeout.total_seconds())


def test_l2_an_op_without_a_deadline_lifts_c10ds_timeout_out_of_reach() -> None:
    import math

    from agang._backends.c10d.backend import C10dBackend
    from agang._engine.engine import Engine
    from agang._policy import make_policy

    group = _TimedGroup()
    backend = C10dBackend(
        group,  # type: ignore[arg-type]
        device=torch.device("cpu"),
        kind="nccl",
        name="timed",
        is_world=False,
        registered=False,
    )
    engine = Engine(backend, make_policy(op_timeout=10.0))
    assert group.timeouts == [45.0]  # 1.5 x 10 s + 30 s: behind agang's deadline

    assert engine.resolve_timeout(math.inf) is None
    assert group.timeouts[-1] >= 7 * 86400  # c10d's own timer never fires first


def test_l2_doctor_warns_when_the_monitor_can_kill_the_process() -> None:
    from agang._cli.doctor.findings import Status
    from agang._cli.doctor.host import HostFacts, backend_findings

    gpu = HostFacts("2.11.0", True, True, True, True, 1, "12.8", "2.27.3", 8)
    findings = {f.check: f for f in backend_findings({"TORCH_NCCL_ENABLE_MONITORING": "1"}, gpu)}

    assert findings["TORCH_NCCL_ENABLE_MONITORING"].status is Status.WARN
    assert findings["TORCH_NCCL_DUMP_ON_TIMEOUT"].status is Status.OK


# L1: order checking + create_gang on an NCCL world hung the non-members.


class _Rank2(_Group):
    def rank(self) -> int:
        return 2


def _record_new_groups(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []

    class Default:
        bound_device_id = torch.device("cuda", 0)

    def new_group(ranks: Any = None, **kwargs: Any) -> Any:
        calls.append({"ranks": ranks, **kwargs})
        return "side"

    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", lambda: Default())
    monkeypatch.setattr(dist, "split_group", lambda **kwargs: None, raising=False)
    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank)
    return calls


@pytest.mark.anyio
async def test_l1_order_checked_sub_gang_asks_nothing_of_nccl_non_members(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _record_new_groups(monkeypatch)

    group, side = await _create(_Rank2(), with_side_group=True)

    # A world new_group joined by a non-member would split NCCL's world communicator on
    # that rank alone: the non-member makes no group at all.
    assert (group, side) == (None, None)
    assert calls == []


@pytest.mark.anyio
async def test_l1_members_make_the_side_group_among_themselves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _record_new_groups(monkeypatch)
    monkeypatch.setattr(dist, "split_group", lambda **kwargs: "split", raising=False)

    group, side = await _create(with_side_group=True)

    assert (group, side) == ("split", "side")
    assert [(c["backend"], c.get("use_local_synchronization")) for c in calls] == [("gloo", True)]


# C3: the caller's thread stayed on GPU 0 after init.


class _UpGang:
    """What init hands back, standing in for an NCCL gang (no GPU here)."""

    device = torch.device("cuda", 1)


def _bind_recorder(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, torch.device]]:
    import threading

    from agang._setup.init import _Plan

    bound: list[tuple[int, torch.device]] = []
    monkeypatch.setattr(
        torch.cuda,
        "set_device",
        lambda device: bound.append((threading.get_ident(), torch.device(device))),
    )
    monkeypatch.setattr(_Plan, "connect", lambda self: _UpGang())
    return bound


_NCCL_INIT: dict[str, Any] = {
    "world": _world(1),
    "in_process": False,
    "backend": "nccl",
    "device": "cuda:1",
    "timeout": 10,
}


@pytest.mark.anyio
async def test_c3_init_binds_the_callers_thread_to_the_gangs_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading

    bound = _bind_recorder(monkeypatch)

    gang = await agang.init(**_NCCL_INIT)

    assert isinstance(gang, _UpGang)
    assert (threading.get_ident(), torch.device("cuda", 1)) in bound


def test_c3_init_sync_binds_the_callers_thread_to_the_gangs_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading

    bound = _bind_recorder(monkeypatch)

    agang.init_sync(**_NCCL_INIT)

    assert (threading.get_ident(), torch.device("cuda", 1)) in bound


# NCCL under torchrun: its agent sets TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (tear down) in
# every worker unless the variable was set for the agent itself.

_TORCHRUN_WORKER = {"TORCHELASTIC_RUN_ID": "job", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def test_torchruns_error_handling_default_is_replaced_so_errors_reach_the_program(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from agang._setup.process import apply_nccl_settings

    environ = dict(_TORCHRUN_WORKER)
    with caplog.at_level("INFO", logger="agang"):
        made = apply_nccl_settings(environ)

    assert environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert made["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert "torchrun" in caplog.text
    assert "AGANG_KEEP_NCCL_SETTINGS" in caplog.text


@pytest.mark.parametrize(
    ("environ", "kept"),
    [
        # The user asked to keep it: torchrun's default and a user's 1 look alike.
        ({**_TORCHRUN_WORKER, "AGANG_KEEP_NCCL_SETTINGS": "1"}, "1"),
        # A value torchrun never sets is the user's.
        ({"TORCHELASTIC_RUN_ID": "job", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, "3"),
        ({"TORCHELASTIC_RUN_ID": "job", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, "0"),
        # Without torchrun's agent, a 1 is the user's.
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, "1"),
    ],
    ids=["keep-asked", "torchrun-3", "torchrun-0", "no-agent-1"],
)
def test_a_value_the_user_set_is_kept(environ: dict[str, str], kept: str) -> None:
    from agang._setup.process import apply_nccl_settings

    made = apply_nccl_settings(environ)

    assert environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == kept
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in made


def test_doctor_says_init_replaces_torchruns_default() -> None:
    from agang._cli.doctor.findings import Status
    from agang._cli.doctor.host import HostFacts, backend_findings

    gpu = HostFacts("2.11.0", True, True, True, True, 1, "12.8", "2.27.3", 8)
    name = "TORCH_NCCL_ASYNC_ERROR_HANDLING"

    keep = {**_TORCHRUN_WORKER, "AGANG_KEEP_NCCL_SETTINGS": "1"}
    replaced = {f.check: f for f in backend_findings(_TORCHRUN_WORKER, gpu)}[name]
    kept = {f.check: f for f in backend_findings(keep, gpu)}[name]

    assert replaced.status is Status.OK
    assert "torchrun's default" in replaced.seen
    assert "sets 2" in replaced.seen
    assert kept.status is Status.WARN


# A lazily made NCCL communicator: made by the first op, on the loop, under the engine
# lock, where a missing member would hold the loop until NCCL gives up. agang makes it
# on the creating thread instead, within the deadline.


@pytest.mark.anyio
async def test_a_child_made_by_new_group_connects_at_once_on_its_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _record_new_groups(monkeypatch)

    class Unbound:
        bound_device_id = None

    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", lambda: Unbound())
    device = torch.device("cuda", 1)

    await c10d_children.create_groups(
        _Group(),  # type: ignore[arg-type]
        [0, 1],
        kind="nccl",
        is_world=True,
        with_side_group=True,
        high_priority=False,
        backstop=60.0,
        seconds=10.0,
        parent_name="root",
        device=device,
    )

    nccl, gloo = calls
    assert nccl["device_id"] == device  # c10d connects a new group given its device
    assert gloo.get("device_id") is None  # the side group is Gloo's: no device


def test_a_world_made_without_a_device_connects_on_the_init_thread() -> None:
    from agang._backends.c10d.calls import connect_eagerly

    connected: list[torch.device] = []

    class Backend:
        def eager_connect_single_device(self, device: torch.device) -> None:
            connected.append(device)

    class World:
        bound_device_id = None

        def _get_backend(self, device: torch.device) -> Backend:
            return Backend()

    class Bound(World):
        bound_device_id = torch.device("cuda", 0)

    device = torch.device("cuda", 0)
    connect_eagerly(World(), device)  # type: ignore[arg-type]
    connect_eagerly(Bound(), device)  # type: ignore[arg-type]  # connected already

    assert connected == [device]
