"""NCCL set-up defects that need no GPU to show: the device index and splitting groups.

- C6: ``init(device="cuda")`` (no index) used to keep the bare device, which every later
  step refuses (``torch.cuda.set_device``, ``init_process_group(device_id=...)``, the
  tensor checks); it now means this rank's GPU, as ``device=None`` does.
- C7: a sub-gang or lane of an NCCL world was always made by ``split_group``, which
  refuses a default group made without ``device_id`` (a world the user set up before
  ``agang.init``); such a world now gets ``new_group``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import agang
from agang._backends import c10d_children
from agang._setup.device import resolve_device


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
        pytest.skip("CUDA is available here")
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


async def _create(**options: Any) -> tuple[Any, Any]:
    return await c10d_children.create_groups(
        _Group(),  # type: ignore[arg-type]
        [0, 1],
        kind="nccl",
        is_world=True,
        with_side_group=False,
        high_priority=False,
        backstop=60.0,
        seconds=10.0,
        parent_name="root",
        **options,
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
