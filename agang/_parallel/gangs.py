"""The current gangs of a task (fairseq2's ``Gangs``), and small helpers over a gang.

The current gangs live in a ``contextvars.ContextVar``, not in a thread-local as in
fairseq2: with asyncio and trio many tasks share a thread, and each must see its own. A
task started inside ``with gangs:`` copies its parent's context, so it sees the gangs
current when it was started; what it sets itself never leaks back to the parent.
"""

from __future__ import annotations

import contextvars
from collections.abc import Sequence
from dataclasses import dataclass, fields
from types import TracebackType
from typing import TYPE_CHECKING, overload

import torch

from agang._gang import Gang

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from agang._collective.process_group_gang import ProcessGroupGang

# A stack rather than one value with reset tokens: one Gangs object may be entered by
# several tasks at once, or nested in itself, and a token stored on the (frozen) object
# would be overwritten by the second entry.
_current: contextvars.ContextVar[tuple[Gangs, ...]] = contextvars.ContextVar(
    "agang_current_gangs", default=()
)

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


def check_gang(gang: object, *, name: str) -> Gang:
    if not isinstance(gang, Gang):
        raise TypeError(
            f"`{name}` must be an `agang.Gang`, but is of type `{type(gang).__name__}` instead."
        )
    return gang


@dataclass(frozen=True, kw_only=True)
class Gangs:
    """The gangs of one process for data, tensor and pipeline parallelism.

    Made by [`agang.create_parallel_gangs`][agang.create_parallel_gangs] and
    [`agang.create_fsdp_gangs`][agang.create_fsdp_gangs], or by hand (for instance of
    [`agang.FakeGang`][agang.FakeGang] objects in tests). A dimension of size 1 is a ``FakeGang`` of
    size 1, so code can use every field without checking for None.

    ``with gangs:`` makes them the current gangs of this task (and of the tasks it starts) until the
    block ends; [`agang.current_gangs`][agang.current_gangs] returns them. Blocks nest: leaving one
    restores the gangs current before it.

    Attributes:
        root: The gang of every process.
        dp: The data-parallel gang: the processes that hold the same model shard.
        rdp: The replicated data-parallel gang (inter-node for hybrid sharding).
        sdp: The sharded data-parallel gang (intra-node for hybrid sharding; ``dp``
            otherwise).
        tp: The tensor-parallel gang.
        pp: The pipeline-parallel gang.

    Raises:
        TypeError: A field is not an [`agang.Gang`][agang.Gang].
        ValueError: ``root.rank`` is 0 but this process is not rank 0 of every other gang
            (rank 0 of the root must coordinate every gang, as in fairseq2).

    Example:
        ```python
        import asyncio

        import torch

        import agang
        from agang.testing import FakeWorld


        async def train():
            tp = agang.current_gangs().tp  # found by the code that needs it
            return (await tp.all_reduce(torch.ones(1))).item()


        async def step(root):
            gangs = await agang.create_parallel_gangs(root, tp_size=2)
            with gangs:
                result = await train()
            await gangs.close()
            return result


        assert asyncio.run(FakeWorld(4).run(step)) == [2.0] * 4
        ```
    """

    root: Gang
    dp: Gang
    rdp: Gang
    sdp: Gang
    tp: Gang
    pp: Gang

    def __post_init__(self) -> None:
        for field in fields(self):
            check_gang(getattr(self, field.name), name=field.name)
        if self.root.rank == 0:
            for field in fields(self):
                rank = getattr(self, field.name).rank
                if rank != 0:
                    raise ValueError(
                        f"`{field.name}.rank` must be 0 on rank 0 of the root gang, "
                        f"but is {rank} instead."
                    )

    def __enter__(self) -> Gangs:
        _current.set((*_current.get(), self))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        stack = _current.get()
        if not stack or stack[-1] is not self:
            # Only possible when blocks are left out of order, or in another context
            # than the one they were entered in (an async generator resumed elsewhere).
            raise RuntimeError(
                "`with gangs:` blocks must be left in the reverse order they were entered, "
                "in the task that entered them, but these gangs are not the current ones."
            )
        _current.set(stack[:-1])

    @classmethod
    def from_device_mesh(
        cls,
        mesh: DeviceMesh,
        *,
        root: ProcessGroupGang | None = None,
        dp: str | None = None,
        tp: str | None = None,
        pp: str | None = None,
        rdp: str | None = None,
        sdp: str | None = None,
    ) -> Gangs:
        """Wraps the process groups of ``mesh``'s dimensions as gangs; creates none.

        Each keyword names the mesh dimension that becomes that gang; with none, the
        dimensions are mapped by their names (agang's, and torchtitan's ``dp_replicate``
        as ``rdp`` and ``dp_shard`` as ``sdp``). Every dimension of size > 1 must map to
        a gang: one left over is an error, never a gang of size 1 whose collectives do
        nothing. A gang whose dimension the mesh lacks (or has of size 1 and unnamed) is a
        size-1 [`agang.FakeGang`][agang.FakeGang]; ``sdp`` defaults to ``dp``, and ``dp`` to the one
        of ``rdp`` and ``sdp`` that spans more than one rank. Nothing is
        communicated, so ranks need not call it in step. The gangs borrow the mesh's
        groups: closing one leaves its group to the mesh, which stays usable. (Closing
        ``root``, as [`close`][agang.Gangs.close] does, closes agang's world gang if it is the root,
        and that destroys every c10d group.) A failure that breaks a gang (a deadline passed, a peer
        lost) aborts its group, as it must to end the hung op: the mesh's group is
        then broken too.

        The root is ``root`` if given, else the open agang world gang (from
        [`agang.init`][agang.init]), else a gang borrowing c10d's default group. A dimension
        whose group is the root's is the root. The borrowed gangs take the root's
        deadlines and in-flight bounds, without order checks (each would need a new
        side group).

        Args:
            mesh: A mesh over the root's ranks, on its device type.
            root: The gang of every rank of ``mesh``, or None (see above).
            dp: The mesh dimension of data parallelism.
            tp: The mesh dimension of tensor parallelism.
            pp: The mesh dimension of pipeline parallelism.
            rdp: The mesh dimension that replicates shards (hybrid sharding).
            sdp: The mesh dimension that shards (hybrid sharding).

        Returns:
            This rank's gangs.

        Raises:
            TypeError: ``mesh`` is not a ``DeviceMesh``, ``root`` not a
                [`agang.ProcessGroupGang`][agang.ProcessGroupGang], or a dimension name not a str.
            ValueError: A name is not a dimension of ``mesh``, a dimension of size > 1
                maps to no gang, ``mesh`` spans other ranks or another device type than
                the root, ``root`` is closed, or ``rdp`` and ``sdp`` both span more than
                one rank without ``dp``.

        Example:
            <!-- not-run: needs a DeviceMesh of 8 GPUs -->
            ```python
            mesh = init_device_mesh("cuda", (4, 2), mesh_dim_names=("dp", "tp"))
            gangs = agang.Gangs.from_device_mesh(mesh, dp="dp", tp="tp")
            await gangs.tp.all_reduce(partial_activations)
            ```
        """
        from agang._parallel.mesh import gangs_from_device_mesh  # imports torch's DeviceMesh

        names = {"dp": dp, "tp": tp, "pp": pp, "rdp": rdp, "sdp": sdp}
        return cls(**gangs_from_device_mesh(mesh, root=root, names=names))

    def device_mesh(self, dims: Sequence[str] | None = None) -> DeviceMesh:
        """A ``DeviceMesh`` over these gangs' process groups; creates no communicator.

        DTensor, functional collectives and FSDP2 (``fully_shard(model, mesh=...)``) then run on
        agang's groups. The gangs must lie as [`create_parallel_gangs`][agang.create_parallel_gangs]
        and [`create_fsdp_gangs`][agang.create_fsdp_gangs] lay them out (the root's ranks in a
        ``(pp, dp, tp)`` grid, ``dp`` split as ``(rdp, sdp)``); each gang's ranks are checked
        against it. The mesh's dimensions are named as the gangs. Nothing is communicated. The
        groups stay agang's: closing the gangs destroys them, and the mesh with them.

        Args:
            dims: The gangs to make the mesh's dimensions of, in order, among ``"pp"``,
                ``"dp"``, ``"rdp"``, ``"sdp"`` and ``"tp"`` (``dp`` excludes ``rdp`` and
                ``sdp``). None: those of size > 1 among ``pp``, ``dp``, ``tp``, with
                ``rdp`` and ``sdp`` for ``dp`` when both are > 1.

        Returns:
            The mesh, named by ``dims``.

        Raises:
            TypeError: ``dims`` is not a sequence of str.
            ValueError: ``dims`` names an unknown or repeated dimension, a gang with no
                c10d group (a ``FakeGang``) or a closed one, or the gangs do not lie
                as ``create_parallel_gangs`` lays them out.

        Example:
            <!-- not-run: needs a DeviceMesh of several processes -->
            ```python
            mesh = gangs.device_mesh(("dp", "tp"))
            weight = distribute_tensor(weight, mesh, [Replicate(), Shard(0)])
            ```
        """
        from agang._parallel.mesh import device_mesh_of  # imports torch's DeviceMesh

        return device_mesh_of({f.name: getattr(self, f.name) for f in fields(self)}, dims)

    async def close(self) -> None:
        """Closes every gang, the sub-gangs before the root.

        Example:
            ```python
            import asyncio

            import agang
            from agang.testing import FakeWorld


            async def step(root):
                gangs = await agang.create_parallel_gangs(root, tp_size=2)
                await gangs.close()  # the sub-gangs, then the root gang
                return root.closed


            assert asyncio.run(FakeWorld(4).run(step)) == [True] * 4
            ```
        """
        distinct: list[Gang] = []
        for gang in (self.rdp, self.sdp, self.tp, self.pp, self.dp, self.root):
            if all(gang is not seen for seen in distinct):
                distinct.append(gang)
        for gang in distinct:
            await gang.close()


def current_gangs() -> Gangs:
    """Returns the gangs set by the innermost ``with gangs:`` block of this task.

    Returns:
        The current [`Gangs`][agang.Gangs].

    Raises:
        LookupError: No gangs are current in this task (the builtin error that
            ``contextvars.ContextVar.get`` raises for an unset variable).

    Example:
        ```python
        import asyncio

        import agang
        from agang.testing import FakeWorld


        async def step(root):
            gangs = await agang.create_parallel_gangs(root, tp_size=2)
            with gangs:
                assert agang.current_gangs() is gangs
            await gangs.close()


        asyncio.run(FakeWorld(4).run(step))
        ```
    """
    stack = _current.get()
    if not stack:
        raise LookupError(
            "No gangs are current in this task; enter `with gangs:` first, where `gangs` "
            "comes from `agang.create_parallel_gangs` (tasks started inside the block "
            "inherit them)."
        )
    return stack[-1]


# The helpers' `timeout` is the collective's deadline, passed through to it (a deadline
# that breaks the gang, unlike a cancel scope around the call): hence the ASYNC109 ignores.


async def broadcast_flag(
    gang: Gang,
    flag: bool,
    source_rank: int = 0,
    *,
    timeout: float | None = None,  # noqa: ASYNC109
) -> bool:
    """Returns ``source_rank``'s ``flag`` on every rank of ``gang``.

    Every rank of ``gang`` must call it (it is a broadcast).

    Args:
        gang: The gang to broadcast over.
        flag: This rank's flag; only ``source_rank``'s is used.
        source_rank: The rank whose flag every rank gets.
        timeout: Seconds before the broadcast's deadline; None for the gang's default.

    Returns:
        ``source_rank``'s flag.

    Raises:
        TypeError: ``gang`` is not a gang, or ``flag`` is not a bool.
        ValueError: ``source_rank`` is not a rank of ``gang``.

    Example:
        ```python
        import asyncio

        import agang
        from agang.testing import FakeWorld


        async def step(gang):
            converged = gang.rank == 0  # only rank 0's value counts
            return await agang.broadcast_flag(gang, gang.rank == 0 and converged)


        assert asyncio.run(FakeWorld(2).run(step)) == [True, True]
        ```
    """
    check_gang(gang, name="gang")
    if not isinstance(flag, bool):
        raise TypeError(f"`flag` must be a bool, but is of type `{type(flag).__name__}` instead.")
    tensor = torch.tensor([flag], dtype=torch.bool, device=gang.device)
    await gang.broadcast(tensor, source_rank, timeout=timeout)
    return bool(tensor.item())


@overload
async def all_sum(
    gang: Gang,
    value: int,
    *,
    timeout: float | None = None,  # noqa: ASYNC109
) -> int: ...


@overload
async def all_sum(
    gang: Gang,
    value: float,
    *,
    timeout: float | None = None,  # noqa: ASYNC109
) -> float: ...


async def all_sum(
    gang: Gang,
    value: float | int,
    *,
    timeout: float | None = None,  # noqa: ASYNC109
) -> float | int:
    """Returns the sum of ``value`` over the ranks of ``gang``.

    Every rank of ``gang`` must call it, all with ints or all with floats. Ints are summed
    exactly as int64 (a sum past the int64 range wraps around, as in c10d); floats as
    float64.

    Args:
        gang: The gang to sum over.
        value: This rank's value.
        timeout: Seconds before the all-reduce's deadline; None for the gang's default.

    Returns:
        The sum: an int if ``value`` is an int, a float otherwise.

    Raises:
        TypeError: ``gang`` is not a gang, or ``value`` is not an int or a float (a bool is
            refused: sum ``int(flag)`` to count ranks).
        ValueError: ``value`` is an int outside the int64 range.

    Example:
        ```python
        import asyncio

        import agang
        from agang.testing import FakeWorld


        async def step(gang):
            batch_tokens = list(range(gang.rank + 1))  # rank r has r + 1 tokens
            return await agang.all_sum(gang, len(batch_tokens))


        assert asyncio.run(FakeWorld(2).run(step)) == [3, 3]
        ```
    """
    check_gang(gang, name="gang")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"`value` must be an int or a float, but is of type `{type(value).__name__}` instead."
        )
    if isinstance(value, int):
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise ValueError(f"`value` must fit in an int64, but is {value} instead.")
        tensor = torch.tensor([value], dtype=torch.int64, device=gang.device)
        await gang.all_reduce(tensor, timeout=timeout)
        return int(tensor.item())
    tensor = torch.tensor([value], dtype=torch.float64, device=gang.device)
    await gang.all_reduce(tensor, timeout=timeout)
    return float(tensor.item())
