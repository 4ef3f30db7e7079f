"""DeviceMesh interop on real Gloo ranks: mesh -> Gangs, Gangs -> mesh -> DTensor, FSDP2.

Each rank counts c10d's groups (``_world.pg_map``) and the calls to ``new_group`` and
``split_group`` around the interop, to prove that neither direction makes a
communicator. Programs are module-level (ranks import them by name) and report plain
values that the test asserts; one world runs every check, as starting ranks costs most.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import agang
from agang.testing import run_world

pytestmark = pytest.mark.gloo


class GroupCounter:
    """Counts c10d's groups and the calls that would make one, from ``start`` on."""

    def __init__(self) -> None:
        self.calls = 0
        self.groups = 0
        for name in ("new_group", "split_group"):
            original: Callable[..., Any] = getattr(dist, name)

            def counting(*args: Any, _original: Callable[..., Any] = original, **kw: Any) -> Any:
                self.calls += 1
                return _original(*args, **kw)

            setattr(dist, name, counting)

    def start(self) -> None:
        self.calls = 0
        self.groups = len(dist.distributed_c10d._world.pg_map)

    def made(self) -> tuple[int, int]:
        """(calls to new_group/split_group, groups added) since ``start``."""
        return self.calls, len(dist.distributed_c10d._world.pg_map) - self.groups


async def members(gang: agang.Gang, rank: int) -> list[int]:
    """The world ranks of ``gang``'s members, from a sum of one bit per member."""
    total = int((await gang.all_reduce(torch.tensor([2**rank], dtype=torch.int64))).item())
    return [r for r in range(total.bit_length()) if total >> r & 1]


def error_of(call: Callable[[], Any]) -> str:
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


async def blame_answered(gang: agang.Gang) -> list[bool]:
    """Asks ``gang``'s peers, as a deadline's blame does, where they stand on op 0;
    whether each answered."""
    import threading

    import anyio

    answers: list[bool] = []
    reported = threading.Event()

    def report(peers: Any, note: str) -> None:
        answers.extend(answer is not None for answer in (peers or {None: None}).values())
        reported.set()

    gang._backend.start_blame(0, report)  # type: ignore[attr-defined]
    await anyio.to_thread.run_sync(reported.wait, 5.0)
    return answers


async def _mesh_to_gangs(root: agang.Gang, rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    counter = GroupCounter()
    counter.start()
    gangs = agang.Gangs.from_device_mesh(mesh, root=root, dp="dp", tp="tp")
    # The open world gang as root; the dimensions mapped by their names.
    implicit = agang.Gangs.from_device_mesh(mesh)
    report: dict[str, Any] = {
        "tp": await members(gangs.tp, rank),
        "dp": await members(gangs.dp, rank),
        "ranks": (gangs.dp.rank, gangs.tp.rank),
        "same_groups": (
            gangs.dp.process_group is mesh.get_group("dp")  # type: ignore[attr-defined]
            and gangs.tp.process_group is mesh.get_group("tp")  # type: ignore[attr-defined]
        ),
        "root_is_root": gangs.root is root and implicit.root is root and gangs.sdp is gangs.dp,
        "fakes": [gangs.pp.size, gangs.rdp.size, implicit.pp.size],
        "by_name": (
            implicit.dp.process_group is mesh.get_group("dp")  # type: ignore[attr-defined]
            and implicit.tp.process_group is mesh.get_group("tp")  # type: ignore[attr-defined]
        ),
    }
    await implicit.tp.all_reduce(torch.ones(1))
    report["made"] = counter.made()
    # (c) Closing agang's wrappers leaves the mesh's groups to the mesh. The tp group is
    # wrapped twice: with one wrapper closed on every rank, the other still answers a
    # peer's blame (closing one once stopped the answers for both: "no answer").
    for gang in (gangs.dp, gangs.tp):
        await gang.close()
    await implicit.tp.all_reduce(torch.ones(1))  # every rank has closed them
    report["blame_answered"] = await blame_answered(implicit.tp)
    # Both ranks have asked before either stops answering (closing first made a slower
    # peer's question go unanswered: CI saw [False]).
    await implicit.tp.all_reduce(torch.ones(1))
    await implicit.tp.close()
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=mesh.get_group("tp"))
    from torch.distributed.tensor import DTensor, Replicate, Shard

    shard = DTensor.from_local(torch.full((1,), float(rank)), mesh, [Replicate(), Shard(0)])
    report["after_close"] = (
        total.item(),
        shard.redistribute(mesh, [Replicate(), Replicate()]).to_local().tolist(),
        counter.made(),
    )
    # (d) Bad input names the parameter.
    report["errors"] = [
        error_of(lambda: agang.Gangs.from_device_mesh(mesh, root=root, tp="model")),
        error_of(lambda: agang.Gangs.from_device_mesh(mesh, root=root, tp=1)),  # type: ignore[arg-type]
        error_of(lambda: agang.Gangs.from_device_mesh("mesh", dp="dp")),  # type: ignore[arg-type]
        error_of(lambda: agang.Gangs.from_device_mesh(mesh, root=agang.FakeGang(), dp="dp")),  # type: ignore[arg-type]
        error_of(lambda: agang.Gangs.from_device_mesh(mesh["tp"], root=root, tp="tp")),
        error_of(lambda: agang.Gangs.from_device_mesh(mesh, root=root, rdp="dp", sdp="tp")),
        error_of(lambda: agang.Gangs.from_device_mesh(mesh, root=root, tp="tp")),
    ]
    # (e) torchtitan's names map to agang's; a dimension agang has no gang for is refused.
    titan = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    mapped = agang.Gangs.from_device_mesh(titan, root=root)
    report["titan"] = (
        [mapped.dp.size, mapped.rdp.size, mapped.sdp.size, mapped.tp.size, mapped.pp.size],
        mapped.sdp is mapped.dp and mapped.dp.process_group is titan.get_group("dp_shard"),  # type: ignore[attr-defined]
    )
    context = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    report["cp"] = error_of(lambda: agang.Gangs.from_device_mesh(context, root=root))
    # (f) Flattened dimensions (HSDP's "dp", torchtitan's "dp_shard_cp") are dimensions.
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    hsdp["dp_replicate", "dp_shard"]._flatten("dp")
    flat = agang.Gangs.from_device_mesh(hsdp, root=root)
    report["flattened"] = (
        [flat.dp.size, flat.rdp.size, flat.sdp.size],
        flat.dp.process_group is hsdp.get_group("dp"),  # type: ignore[attr-defined]
    )
    sharded = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
    sharded["dp_shard", "cp"]._flatten("dp_shard_cp")
    wide = agang.Gangs.from_device_mesh(sharded, root=root, dp="dp_shard_cp")
    report["dp_shard_cp"] = [wide.dp.size, wide.sdp.size, wide.tp.size]
    report["dp_shard_cp_total"] = await members(wide.dp, rank)
    return report


async def _gangs_to_mesh(root: agang.Gang, rank: int) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    gangs = await agang.create_parallel_gangs(root, tp_size=2)
    hybrid = await agang.create_fsdp_gangs(await agang.create_parallel_gangs(root), 2)
    counter = GroupCounter()
    counter.start()
    mesh = gangs.device_mesh()
    assert isinstance(gangs.tp, agang.ProcessGroupGang)
    assert isinstance(gangs.dp, agang.ProcessGroupGang)
    report: dict[str, Any] = {
        "names": mesh.mesh_dim_names,
        "mesh": mesh.mesh.tolist(),
        "same_groups": (
            mesh.get_group("tp") is gangs.tp.process_group
            and mesh.get_group("dp") is gangs.dp.process_group
        ),
        "transposed": gangs.device_mesh(("tp", "dp")).mesh.tolist(),
        "tp_only": gangs.device_mesh(["tp"]).mesh.tolist(),
        "hybrid": (hybrid.device_mesh().mesh_dim_names, hybrid.device_mesh().mesh.tolist()),
        "hybrid_dp": hybrid.device_mesh(("dp",)).mesh.tolist(),
    }
    # (b) DTensor on agang's groups: rows sharded over tp gathered back; a partial sum
    # over dp reduced.
    full = torch.arange(8.0).reshape(4, 2)
    tp_rank = gangs.tp.rank
    rows = DTensor.from_local(full[2 * tp_rank : 2 * tp_rank + 2], mesh, [Replicate(), Shard(0)])
    partial = DTensor.from_local(torch.full((2,), gangs.dp.rank + 1.0), mesh, [Partial(), Shard(0)])
    report["dtensor"] = (
        torch.equal(rows.redistribute(mesh, [Replicate(), Replicate()]).to_local(), full),
        partial.redistribute(mesh, [Replicate(), Replicate()]).to_local().tolist(),
    )
    report["agang_tp"] = (await gangs.tp.all_reduce(torch.tensor([float(rank)]))).item()
    report["made"] = counter.made()
    report["errors"] = [
        error_of(lambda: gangs.device_mesh(("dp", "model"))),
        error_of(lambda: gangs.device_mesh("dp")),
        error_of(lambda: gangs.device_mesh(("pp",))),
        error_of(lambda: hybrid.device_mesh(("dp", "sdp"))),
    ]
    return report


async def _interop(root: agang.Gang) -> dict[str, Any]:
    rank = root.rank
    return {
        "mesh_to_gangs": await _mesh_to_gangs(root, rank),
        "gangs_to_mesh": await _gangs_to_mesh(root, rank),
    }


def test_device_mesh_round_trip_on_gloo() -> None:
    reports = run_world(_interop, 4, timeout=90.0)

    for rank, report in enumerate(reports):
        got = report["mesh_to_gangs"]
        # (a) dp x tp as init_device_mesh lays it out: tp [0, 1] [2, 3], dp [0, 2] [1, 3].
        assert got["tp"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert got["dp"] == [rank % 2, rank % 2 + 2]
        assert got["ranks"] == (rank // 2, rank % 2)
        assert got["same_groups"]
        assert got["root_is_root"]
        assert got["fakes"] == [1, 1, 1]
        assert got["made"] == (0, 0)
        assert got["blame_answered"] == [True]  # the one peer in tp
        # (c) The mesh's groups still work after agang's wrappers closed, and none went.
        tp_sum = float(2 * (rank - rank % 2) + 1)
        assert got["after_close"] == (tp_sum, [2.0 * (rank // 2), 2.0 * (rank // 2) + 1], (0, 0))
        # (d)
        model, not_str, not_mesh, not_root, other_world, no_dp, left_out = got["errors"]
        assert model.startswith("ValueError: `tp` must name a dimension of `mesh`")
        assert "'model'" in model
        assert "['dp', 'tp']" in model
        assert not_str.startswith("TypeError: `tp` must be a mesh dimension name")
        assert not_mesh.startswith("TypeError: `mesh` must be a `torch.distributed")
        assert not_root.startswith("TypeError: `root` must be an `agang.ProcessGroupGang`")
        assert other_world.startswith("ValueError: `mesh` must span the ranks")
        assert no_dp.startswith("ValueError: `dp` must be given with `rdp` and `sdp`")
        # A dimension of size > 1 left to a size-1 gang is refused, never a silent no-op.
        assert left_out.startswith("ValueError: `mesh` dimension 'dp' maps to no gang"), left_out
        assert "'dp' (size 2), 'tp' (size 2)" in left_out
        assert "`sdp`" in left_out
        assert got["by_name"]
        assert got["titan"] == ([2, 1, 2, 2, 1], True)
        assert got["cp"].startswith("ValueError: `mesh` dimension 'cp' maps to no gang")
        assert got["flattened"] == ([4, 2, 2], True)
        assert got["dp_shard_cp"] == [4, 4, 1]
        assert got["dp_shard_cp_total"] == [0, 1, 2, 3]

        got = report["gangs_to_mesh"]
        assert got["names"] == ("dp", "tp")
        assert got["mesh"] == [[0, 1], [2, 3]]
        assert got["same_groups"]
        assert got["transposed"] == [[0, 2], [1, 3]]
        assert got["tp_only"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert got["hybrid"] == (("rdp", "sdp"), [[0, 1], [2, 3]])
        assert got["hybrid_dp"] == [0, 1, 2, 3]
        assert got["dtensor"] == (True, [3.0] * 4)  # 1 + 2 over dp, 2 + 2 rows over tp
        assert got["agang_tp"] == float(2 * (rank - rank % 2) + 1)
        assert got["made"] == (0, 0)
        unknown, a_str, fake, overlap = got["errors"]
        assert unknown.startswith("ValueError: `dims` must be names among")
        assert a_str.startswith("TypeError: `dims` must be a sequence")
        assert fake.startswith("ValueError: `dims` names 'pp', but `gangs.pp` is a `FakeGang`")
        assert overlap.startswith("ValueError: `dims` must name each dimension once")


async def _fsdp2(root: agang.Gang) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    gangs = await agang.create_parallel_gangs(root, tp_size=2)
    mesh = gangs.device_mesh(("dp",))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    reference.load_state_dict(model.state_dict())
    data = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    counter = GroupCounter()
    counter.start()
    fully_shard(model, mesh=mesh)
    # Each dp rank takes its half of the batch; FSDP2 averages gradients over dp.
    dp_rank = gangs.dp.rank
    model(data[2 * dp_rank : 2 * dp_rank + 2]).sum().backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]  # type: ignore[union-attr]
    (reference(data).sum() / 2).backward()
    return {
        "close": all(
            torch.allclose(g, p.grad, atol=1e-6)  # type: ignore[arg-type]
            for g, p in zip(grads, reference.parameters(), strict=True)
        ),
        "finite": all(bool(g.isfinite().all()) for g in grads),
        "made": counter.made(),
    }


def test_fully_shard_on_the_mesh_of_agangs_gangs() -> None:
    reports = run_world(_fsdp2, 4, timeout=90.0)

    assert [r["close"] for r in reports] == [True] * 4
    assert [r["finite"] for r in reports] == [True] * 4
    assert [r["made"] for r in reports] == [(0, 0)] * 4
