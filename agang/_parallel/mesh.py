"""Interop with torch's ``DeviceMesh``: its groups as agang gangs, agang's gangs as a mesh.

Rules:
1. Neither direction creates a communicator. ``gangs_from_device_mesh`` wraps the groups
   the mesh already holds; ``device_mesh_of`` hands agang's groups to
   ``DeviceMesh.from_group``. Both run no collective and need not be called in step.
2. A gang over a mesh's group borrows it: closing the gang stops agang's use of it and
   leaves the group to the mesh (``C10dBackend(owned=False)``). Only a failure (a
   deadline passed, a lost peer) or a close with ops still running aborts the borrowed
   group, as it must to end a hung op; the mesh's group is then broken too.
3. The root is the caller's gang if given, else the open agang world gang, else a
   borrowed gang over c10d's default group. A mesh dimension whose group is the root's
   is the root itself, and one group named twice is one gang.
4. Borrowed gangs take the root's policy (deadlines, in-flight bounds) without order
   checks: those need a side group per gang, a new communicator.
5. agang's gangs lie as ``create_parallel_gangs`` and ``create_fsdp_gangs`` lay them
   out: root ranks in a ``(pp, rdp, sdp, tp)`` row-major grid, ``dp`` being ``rdp`` x
   ``sdp``. ``device_mesh_of`` builds the mesh from that grid, and checks each gang's
   ranks against it first, so a hand-made ``Gangs`` that lies otherwise is refused
   rather than mislabelled.
6. *Every dimension of size > 1 becomes a gang, never a silent size-1 one.* With no
   keyword, the mesh's dimensions are mapped by name: agang's own (``dp``, ``tp``,
   ``pp``, ``rdp``, ``sdp``) and torchtitan's ``dp_replicate`` (``rdp``) and
   ``dp_shard`` (``sdp``). Where ``rdp`` or ``sdp`` is named and ``dp`` is not, ``dp``
   is the one of them of size > 1 (the other replicates or shards over one rank, so the
   data-parallel group is that one); both of size > 1 need a ``dp`` dimension spanning
   them, which agang cannot make without a new group. A dimension of size > 1 that maps
   to no gang (``cp``, an unknown name, one the keywords leave out) is an error that
   lists the mesh's dimensions and the keywords: a ``gangs.tp.all_reduce`` that does
   nothing would corrupt a model silently.
7. Dimensions flattened from the mesh's (``mesh["dp_replicate", "dp_shard"]._flatten
   ("dp")``, torchtitan's ``dp_shard_cp``) are dimensions too: torch keeps them on the
   root mesh, and ``get_group`` gives their groups. A mesh dimension that a mapped
   flattened one spans (its group on this rank inside the flattened one's) is mapped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _register_process_group, _resolve_process_group
from torch.distributed.device_mesh import DeviceMesh

from agang._backends.c10d.backend import C10dBackend
from agang._collective.fake_gang import FakeGang
from agang._collective.gang import gang_over
from agang._collective.process_group_gang import ProcessGroupGang, open_world_gang
from agang._gang import Gang
from agang._policy import GangPolicy
from agang._setup import simulation

DIMENSIONS = ("pp", "dp", "rdp", "sdp", "tp")
# The grid's axes (rule 5); dp spans rdp and sdp.
_AXES = {"pp": (0,), "rdp": (1,), "sdp": (2,), "dp": (1, 2), "tp": (3,)}


def _check_mesh(mesh: object) -> DeviceMesh:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"`mesh` must be a `torch.distributed.device_mesh.DeviceMesh`, "
            f"but is of type `{type(mesh).__name__}` instead."
        )
    if not dist.is_initialized():
        raise ValueError("`mesh` needs torch.distributed initialized, but it is not.")
    return mesh


def _global_ranks(group: dist.ProcessGroup) -> list[int]:
    return [int(rank) for rank in dist.get_process_group_ranks(group)]


def _borrow(
    group: dist.ProcessGroup, *, device: torch.device, name: str, policy: GangPolicy
) -> ProcessGroupGang:
    """A gang over ``group`` that leaves it to its owner at close (rule 2)."""
    backend = C10dBackend(
        group,
        device=device,
        kind=simulation.kind_of(str(dist.get_backend(group))),
        name=name,
        is_world=False,
        owned=False,
    )
    return gang_over(ProcessGroupGang, backend, policy)


def _root_of(root: object, device: torch.device) -> ProcessGroupGang:
    """The root of rule 3."""
    if root is not None:
        if not isinstance(root, ProcessGroupGang):
            raise TypeError(
                f"`root` must be an `agang.ProcessGroupGang` or None, "
                f"but is of type `{type(root).__name__}` instead."
            )
        if root.closed:
            raise ValueError(f"`root` must be an open gang, but '{root.name}' is closed.")
        return root
    world = open_world_gang()
    if world is not None:
        return world
    default = dist.distributed_c10d._get_default_group()
    return _borrow(default, device=device, name="mesh:world", policy=GangPolicy())


def gangs_from_device_mesh(
    mesh: object, *, root: object = None, names: dict[str, str | None]
) -> dict[str, Gang]:
    """``Gangs.from_device_mesh``: see its docstring. Returns the fields of a ``Gangs``
    (``root``, ``dp``, ``rdp``, ``sdp``, ``tp``, ``pp``), which the caller builds."""
    mesh = _check_mesh(mesh)
    dim_names = tuple(mesh.mesh_dim_names or ())
    sizes = dict(zip(dim_names, mesh.mesh.shape, strict=False))
    flattened = _flattened(mesh)  # rule 7
    sizes.update({dim: mesh.get_group(dim).size() for dim in flattened})
    if all(dim is None for dim in names.values()):
        names = _names_by_dimension((*dim_names, *flattened))  # rule 6
    for field, dim in names.items():
        if dim is None:
            continue
        if not isinstance(dim, str):
            raise TypeError(
                f"`{field}` must be a mesh dimension name (a str) or None, "
                f"but is of type `{type(dim).__name__}` instead."
            )
        if dim not in dim_names and dim not in flattened:
            raise ValueError(
                f"`{field}` must name a dimension of `mesh` (one of "
                f"{list((*dim_names, *flattened))}), "
                f"but is {dim!r} instead."
            )
    names = _with_dp(names, sizes)
    device = torch.device(mesh.device_type)
    gang = _root_of(root, device)
    if gang.device.type != mesh.device_type:
        raise ValueError(
            f"`mesh` must be on the root gang's device type ({gang.device.type!r}), "
            f"but is on {mesh.device_type!r} instead."
        )
    root_ranks = sorted(_global_ranks(gang.process_group))
    mesh_ranks = sorted(int(rank) for rank in mesh.mesh.flatten().tolist())
    if mesh_ranks != root_ranks:
        raise ValueError(
            f"`mesh` must span the ranks of the root gang '{gang.name}' ({root_ranks}), "
            f"but spans {mesh_ranks} instead."
        )
    _check_every_dimension_mapped(mesh, dim_names, sizes, names, flattened)
    policy = dataclasses.replace(gang.policy, check_order=False)  # rule 4
    gangs: dict[str, Gang] = {}
    wrapped: dict[int, Gang] = {id(gang.process_group): gang}
    for field, dim in names.items():
        if dim is None:
            continue
        group = mesh.get_group(dim)
        if id(group) not in wrapped:
            name = f"{gang.name}/mesh:{dim}"
            wrapped[id(group)] = _borrow(group, device=gang.device, name=name, policy=policy)
        gangs[field] = wrapped[id(group)]

    def fake() -> FakeGang:
        return FakeGang(rank=0, size=1, device=gang.device)

    dp = gangs.get("dp") or fake()
    return {
        "root": gang,
        "dp": dp,
        "rdp": gangs.get("rdp") or fake(),
        "sdp": gangs.get("sdp") or dp,
        "tp": gangs.get("tp") or fake(),
        "pp": gangs.get("pp") or fake(),
    }


# torchtitan's names for its mesh dimensions that are agang's under another name (rule 6).
_ALIASES = {"dp_replicate": "rdp", "dp_shard": "sdp"}
_KEYWORDS = ("dp", "tp", "pp", "rdp", "sdp")


def _flattened(mesh: DeviceMesh) -> tuple[str, ...]:
    """The names of the dimensions flattened from ``mesh``'s (``mesh[...]._flatten(name)``),
    which torch keeps on the root mesh (rule 7)."""
    root = getattr(mesh, "_get_root_mesh", lambda: mesh)()
    if root is not mesh:
        return ()
    mapping = getattr(root, "_flatten_mapping", None) or {}
    return tuple(name for name in mapping if name not in (mesh.mesh_dim_names or ()))


def _names_by_dimension(dim_names: tuple[str, ...]) -> dict[str, str | None]:
    """The keywords the mesh's dimension names give (rule 6)."""
    names: dict[str, str | None] = dict.fromkeys(_KEYWORDS)
    for dim in dim_names:
        field = _ALIASES.get(dim, dim)
        if field in names and names[field] is None:
            names[field] = dim
    return names


def _with_dp(names: dict[str, str | None], sizes: Mapping[str, int]) -> dict[str, str | None]:
    """``dp`` where only ``rdp`` and ``sdp`` were named (rule 6)."""
    rdp, sdp = names["rdp"], names["sdp"]
    if names["dp"] is not None or (rdp is None and sdp is None):
        return names
    wide = [dim for dim in (rdp, sdp) if dim is not None and sizes.get(dim, 1) > 1]
    if len(wide) > 1:
        raise ValueError(
            f"`dp` must be given with `rdp` and `sdp` when both span more than one rank "
            f"({rdp!r} and {sdp!r}): name a dimension of `mesh` that spans both, e.g. "
            f"one flattened from them (agang makes no new group to join them)."
        )
    return {**names, "dp": wide[0] if wide else (sdp if sdp is not None else rdp)}


def _check_every_dimension_mapped(
    mesh: DeviceMesh,
    dim_names: tuple[str, ...],
    sizes: Mapping[str, int],
    names: Mapping[str, str | None],
    flattened: tuple[str, ...] = (),
) -> None:
    """Rule 6: no dimension of size > 1 is left to a size-1 gang; one a mapped flattened
    dimension spans is mapped (rule 7)."""
    if not dim_names:
        if mesh.mesh.numel() > 1:
            raise ValueError(
                f"`mesh` must name its dimensions (`mesh_dim_names`) for agang to map "
                f"them to gangs, but its {tuple(mesh.mesh.shape)} dimensions are unnamed."
            )
        return
    used = {dim for dim in names.values() if dim is not None}
    spans = [set(_global_ranks(mesh.get_group(dim))) for dim in used if dim in flattened]

    def covered(dim: str) -> bool:
        ranks = set(_global_ranks(mesh.get_group(dim)))
        return dim in used or any(ranks <= span for span in spans)

    left = [dim for dim in dim_names if sizes[dim] > 1 and not covered(dim)]
    if left:
        shown = ", ".join(f"{dim!r} (size {sizes[dim]})" for dim in (*dim_names, *flattened))
        given = ", ".join(f"{field}={dim!r}" for field, dim in names.items() if dim) or "none"
        raise ValueError(
            f"`mesh` dimension {', '.join(repr(d) for d in left)} maps to no gang: each "
            f"dimension of size > 1 must be named by one of the keywords "
            f"{', '.join(f'`{k}`' for k in _KEYWORDS)} (without keywords, by its own name: "
            f"agang's, or torchtitan's `dp_replicate`/`dp_shard`), or its collectives "
            f"would run on a size-1 gang and do nothing. The mesh's dimensions: {shown}; "
            f"mapped: {given}. Wrap a sub-mesh without it only over ranks that form a "
            f"gang of their own."
        )


def _default_dims(gangs: Mapping[str, Gang]) -> tuple[str, ...]:
    hybrid = gangs["rdp"].size > 1 and gangs["sdp"].size > 1
    order = ("pp", "rdp", "sdp", "tp") if hybrid else ("pp", "dp", "tp")
    return tuple(dim for dim in order if gangs[dim].size > 1)


def _check_dims(gangs: Mapping[str, Gang], dims: object) -> tuple[str, ...]:
    if dims is None:
        chosen = _default_dims(gangs)
        if not chosen:
            raise ValueError(
                "`dims` must name a dimension when every gang of `gangs` has size 1, but is None."
            )
        return chosen
    if isinstance(dims, str) or not isinstance(dims, Sequence):
        raise TypeError(
            f"`dims` must be a sequence of dimension names, "
            f"but is of type `{type(dims).__name__}` instead."
        )
    chosen = tuple(dims)
    if not chosen or any(dim not in DIMENSIONS for dim in chosen):
        raise ValueError(f"`dims` must be names among {DIMENSIONS}, but is {dims!r} instead.")
    axes = [axis for dim in chosen for axis in _AXES[dim]]
    if len(set(axes)) != len(axes):
        raise ValueError(
            f"`dims` must name each dimension once (dp spans rdp and sdp), but is {dims!r} instead."
        )
    return chosen


def _group_of(gangs: Mapping[str, Gang], dim: str) -> dist.ProcessGroup:
    gang = gangs[dim]
    if not isinstance(gang, ProcessGroupGang) or gang.closed:
        state = "closed" if gang.closed else f"a `{type(gang).__name__}`"
        raise ValueError(
            f"`dims` names {dim!r}, but `gangs.{dim}` is {state}, with no c10d group "
            "to give the mesh (leave size-1 dimensions out)."
        )
    group = gang.process_group
    # Functional collectives and DTensor find a mesh's groups by name (rule 1).
    if group not in dist.distributed_c10d._world.pg_names:
        raise ValueError(f"`gangs.{dim}`'s group is unknown to torch.distributed.")
    try:
        known = _resolve_process_group(group.group_name)
    except Exception:
        known = None
    if known is not group:
        _register_process_group(group.group_name, group)
    return group


def device_mesh_of(gangs: Mapping[str, Gang], dims: object = None) -> DeviceMesh:
    """``Gangs.device_mesh``: see its docstring; ``gangs`` are a ``Gangs``' fields by name."""
    chosen = _check_dims(gangs, dims)
    groups = [_group_of(gangs, dim) for dim in chosen]
    root = gangs["root"]
    if not isinstance(root, ProcessGroupGang):
        raise ValueError(
            f"`gangs.root` must be a `ProcessGroupGang`, but is a `{type(root).__name__}`."
        )
    sizes = {dim: gangs[dim].size for dim in ("pp", "rdp", "sdp", "tp")}
    grid = torch.tensor(_global_ranks(root.process_group), dtype=torch.int64)
    if grid.numel() != sizes["pp"] * gangs["dp"].size * sizes["tp"] or gangs["dp"].size != (
        sizes["rdp"] * sizes["sdp"]
    ):
        raise ValueError(
            "`gangs` must lie as `create_parallel_gangs` lays them out (root size "
            "pp x dp x tp, dp size rdp x sdp), but their sizes do not multiply up."
        )
    grid = grid.view(sizes["pp"], sizes["rdp"], sizes["sdp"], sizes["tp"])
    here = (gangs["pp"].rank, gangs["rdp"].rank, gangs["sdp"].rank, gangs["tp"].rank)
    # Rule 5: every chosen gang must be the line of the grid through this rank.
    for dim, group in zip(chosen, groups, strict=True):
        index = tuple(slice(None) if axis in _AXES[dim] else here[axis] for axis in range(4))
        line = grid[index].flatten().tolist()
        if _global_ranks(group) != line:
            raise ValueError(
                f"`gangs.{dim}` must hold the ranks {line} of the layout of "
                f"`create_parallel_gangs`, but holds {_global_ranks(group)}."
            )
    # Merge rdp and sdp into dp where asked, fix the dimensions not asked for at this
    # rank's place, and order the rest as asked.
    if "dp" in chosen:
        grid = grid.reshape(sizes["pp"], gangs["dp"].size, sizes["tp"])
        names: tuple[str, ...] = ("pp", "dp", "tp")
        place: tuple[int, ...] = (gangs["pp"].rank, gangs["dp"].rank, gangs["tp"].rank)
    else:
        names, place = ("pp", "rdp", "sdp", "tp"), here
    kept = [name for name in names if name in chosen]
    index = tuple(slice(None) if name in chosen else place[i] for i, name in enumerate(names))
    mesh = grid[index].permute(*[kept.index(dim) for dim in chosen]).contiguous()
    return DeviceMesh.from_group(groups, root.device.type, mesh=mesh, mesh_dim_names=chosen)
