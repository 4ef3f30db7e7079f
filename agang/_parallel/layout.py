"""Splitting a root gang into data-, tensor- and pipeline-parallel gangs (fairseq2's layout).

Rules:
1. The root's ranks form a mesh of shape ``(pp_size, dp_size, tp_size)`` in row-major
   order: rank ``r`` sits at ``(r // (dp_size * tp_size), (r // tp_size) % dp_size,
   r % tp_size)``. A gang of one dimension is a line of the mesh along that dimension.
2. So tensor-parallel gangs are runs of ``tp_size`` consecutive ranks (the most
   communication-heavy dimension stays on one host when hosts hold consecutive ranks),
   data-parallel gangs step by ``tp_size``, and pipeline parallelism is the outermost
   dimension, stepping by ``dp_size * tp_size``.
3. Hybrid sharding splits each data-parallel gang the same way, as a mesh of shape
   ``(inter_node_size, intra_node_size)`` over its ranks: sharded gangs (``sdp``) are runs
   of ``intra_node_size`` consecutive data-parallel ranks, replicated gangs (``rdp``) join
   the ranks at the same position of each run.
4. A dimension of size 1 is a ``FakeGang`` of size 1 (no communicator); a dimension as
   large as the gang it splits is that gang itself. Otherwise every rank of that gang
   creates every line in the same order (lowest first, dimension by dimension in the
   order dp, tp, pp, then rdp, sdp), because with c10d every rank of the world must take
   part in creating each group; each rank keeps the one it belongs to.

The data-parallel/tensor-parallel mesh and the hybrid split follow fairseq2's
``create_parallel_gangs`` and ``create_fsdp_gangs`` (facebookresearch/fairseq2,
src/fairseq2/gang.py: ``torch.arange(size).view(dp_size, tp_size)``, tensor-parallel gangs
are its rows, data-parallel gangs its columns, and ``view(inter_node_size,
intra_node_size)`` over the data-parallel ranks). fairseq2 leaves pipeline parallelism as
a TODO there; it is the outermost dimension here, as in Megatron-LM's default order.
"""

from __future__ import annotations

from collections.abc import Sequence

from agang._collective.fake_gang import FakeGang
from agang._errors import GangClosedError, GangError
from agang._gang import Gang
from agang._parallel.gangs import Gangs, check_gang
from agang._validate import check_positive_int


def parallel_groups(world_size: int, *, tp_size: int, pp_size: int) -> dict[str, list[list[int]]]:
    """The groups of each dimension, as lists of root ranks (rules 1 and 2).

    The sizes must already be checked: ``world_size`` a multiple of ``tp_size * pp_size``.
    """
    dp_size = world_size // (tp_size * pp_size)
    block = dp_size * tp_size  # the ranks of one pipeline stage

    def rank(pp: int, dp: int, tp: int) -> int:
        return pp * block + dp * tp_size + tp

    return {
        "dp": [
            [rank(pp, dp, tp) for dp in range(dp_size)]
            for pp in range(pp_size)
            for tp in range(tp_size)
        ],
        "tp": [
            [rank(pp, dp, tp) for tp in range(tp_size)]
            for pp in range(pp_size)
            for dp in range(dp_size)
        ],
        "pp": [
            [rank(pp, dp, tp) for pp in range(pp_size)]
            for dp in range(dp_size)
            for tp in range(tp_size)
        ],
    }


def hybrid_groups(dp_size: int, *, intra_node_size: int) -> dict[str, list[list[int]]]:
    """The replicated (``rdp``) and sharded (``sdp``) groups, as data-parallel ranks (rule 3)."""
    inter_node_size = dp_size // intra_node_size
    return {
        "rdp": [
            [node * intra_node_size + position for node in range(inter_node_size)]
            for position in range(intra_node_size)
        ],
        "sdp": [
            [node * intra_node_size + position for position in range(intra_node_size)]
            for node in range(inter_node_size)
        ],
    }


async def _split(parent: Gang, groups: Sequence[Sequence[int]]) -> Gang:
    """The gang of this rank's group among ``groups``, which partition ``parent`` (rule 4)."""
    size = len(groups[0])
    if size == 1:
        # One fake per dimension, so that each dimension's statistics stay its own.
        return FakeGang(rank=0, size=1, device=parent.device)
    if size == parent.size:
        return parent
    mine: Gang | None = None
    for group in groups:
        gang = await parent.create_gang(group)
        if gang is not None:
            mine = gang
    if mine is None:  # the groups cover every rank, so create_gang returned one
        raise GangError(
            f"Rank {parent.rank} of gang '{parent.name}' is in none of the groups {groups}; "
            f"this is a bug in agang."
        )
    return mine


def _check_open(gang: Gang, *, name: str) -> None:
    if gang.closed:
        raise GangClosedError(f"`{name}` must be an open gang, but '{gang.name}' is closed.")


async def create_parallel_gangs(root: Gang, *, tp_size: int = 1, pp_size: int = 1) -> Gangs:
    """Splits ``root`` into data-, tensor- and pipeline-parallel gangs.

    Every rank of ``root`` must call it, with the same sizes. The ranks form a mesh of
    shape ``(pp_size, dp_size, tp_size)``, ``dp_size`` being ``root.size // (tp_size *
    pp_size)``: tensor-parallel gangs are runs of consecutive ranks, data-parallel gangs
    step by ``tp_size``, pipeline-parallel gangs by ``dp_size * tp_size``. For 8 ranks
    with ``tp_size=2`` and ``pp_size=2``::

        tp: [0, 1] [2, 3] [4, 5] [6, 7]
        dp: [0, 2] [1, 3] [4, 6] [5, 7]
        pp: [0, 4] [1, 5] [2, 6] [3, 7]

    Give hosts consecutive ranks, so that tensor-parallel gangs stay within a host. A
    dimension of size 1 is a [`agang.FakeGang`][agang.FakeGang] of size 1, one as large as ``root``
    is ``root`` itself. ``rdp`` is a size-1 fake gang and ``sdp`` is ``dp``; see
    [`create_fsdp_gangs`][agang.create_fsdp_gangs] for hybrid sharding.

    The new gangs are sub-gangs of ``root``: closing ``root`` closes them. If the call
    fails or is cancelled part way, the gangs made so far stay open until ``root`` is
    closed, and the ranks may disagree on how many were made: close ``root`` rather than
    go on using it.

    Args:
        root: The gang to split, usually the one [`agang.init`][agang.init] returned.
        tp_size: The size of tensor-parallel gangs.
        pp_size: The size of pipeline-parallel gangs (the number of stages).

    Returns:
        This rank's gangs.

    Raises:
        TypeError: ``root`` is not a gang.
        ValueError: A size is not a positive int, or ``root.size`` is not a multiple of
            ``tp_size * pp_size``.
        GangClosedError: ``root`` is closed.
        GangInitError: Creating a sub-gang failed.

    Example:
        <!-- not-run: needs a launched world of 8+ ranks (tp_size=8) -->
        ```python
        root = await agang.init()
        gangs = await agang.create_parallel_gangs(root, tp_size=8)
        await gangs.tp.all_reduce(partial_activations)
        ```
    """
    check_gang(root, name="root")
    check_positive_int(tp_size, name="tp_size")
    check_positive_int(pp_size, name="pp_size")
    if root.size % tp_size:
        raise ValueError(
            f"`tp_size` must be a factor of `root.size` ({root.size}), but is {tp_size} instead."
        )
    if root.size % (tp_size * pp_size):
        raise ValueError(
            f"`pp_size` must be a factor of `root.size // tp_size` ({root.size // tp_size}), "
            f"but is {pp_size} instead."
        )
    _check_open(root, name="root")
    groups = parallel_groups(root.size, tp_size=tp_size, pp_size=pp_size)
    dp = await _split(root, groups["dp"])
    tp = await _split(root, groups["tp"])
    pp = await _split(root, groups["pp"])
    rdp = FakeGang(rank=0, size=1, device=root.device)
    return Gangs(root=root, dp=dp, rdp=rdp, sdp=dp, tp=tp, pp=pp)


async def create_fsdp_gangs(gangs: Gangs, intra_node_size: int | None = None) -> Gangs:
    """Splits the data-parallel gang of ``gangs`` for (hybrid) sharded data parallelism.

    Every rank must call it, with the same ``intra_node_size``. Without one, sharding
    spans the whole data-parallel gang: ``sdp`` is ``dp`` and ``rdp`` a size-1 fake gang.
    With one, ``dp`` is seen as nodes of ``intra_node_size`` consecutive ranks: ``sdp``
    is this rank's node (parameters are sharded within it) and ``rdp`` joins the ranks at
    the same position on every node (shards are replicated across them). For a
    data-parallel gang of 8 with ``intra_node_size=4``::

        sdp: [0, 1, 2, 3] [4, 5, 6, 7]
        rdp: [0, 4] [1, 5] [2, 6] [3, 7]

    The ranks are those of ``gangs.dp``. ``intra_node_size=1`` gives plain replication
    (``sdp`` a fake gang, ``rdp`` is ``dp``).

    Args:
        gangs: The gangs to extend, as [`create_parallel_gangs`][agang.create_parallel_gangs]
            returned them.
        intra_node_size: The size of sharded gangs, or None to shard over all of ``dp``.

    Returns:
        New gangs with ``rdp`` and ``sdp`` set; the other fields are those of ``gangs``.

    Raises:
        TypeError: ``gangs`` is not a [`Gangs`][agang.Gangs].
        ValueError: ``intra_node_size`` is not a positive int, or is not a factor of
            ``gangs.dp.size``.
        GangClosedError: ``gangs.dp`` is closed.
        GangInitError: Creating a sub-gang failed.

    Example:
        <!-- not-run: needs a world of 16+ ranks on several nodes -->
        ```python
        gangs = await agang.create_fsdp_gangs(gangs, intra_node_size=8)
        await gangs.sdp.reduce_scatter(grad_shard, grads)
        ```
    """
    if not isinstance(gangs, Gangs):
        raise TypeError(
            f"`gangs` must be an `agang.Gangs`, but is of type `{type(gangs).__name__}` instead."
        )
    dp = gangs.dp
    if intra_node_size is None:
        fake = FakeGang(rank=0, size=1, device=dp.device)
        return Gangs(root=gangs.root, dp=dp, rdp=fake, sdp=dp, tp=gangs.tp, pp=gangs.pp)
    check_positive_int(intra_node_size, name="intra_node_size")
    if dp.size % intra_node_size:
        raise ValueError(
            f"`intra_node_size` must be a factor of `gangs.dp.size` ({dp.size}), "
            f"but is {intra_node_size} instead."
        )
    _check_open(dp, name="gangs.dp")
    groups = hybrid_groups(dp.size, intra_node_size=intra_node_size)
    rdp = await _split(dp, groups["rdp"])
    sdp = await _split(dp, groups["sdp"])
    return Gangs(root=gangs.root, dp=dp, rdp=rdp, sdp=sdp, tp=gangs.tp, pp=gangs.pp)
