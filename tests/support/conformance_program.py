"""The conformance program: every collective of the Gang interface, as one rank runs it.

It runs unchanged on every Gang implementation (a rank of ``FakeWorld``, a Gloo rank of
``run_world``, a ``FakeGang``) and returns one :class:`Record` per :class:`Case`: what
``await`` returned, the handles' metadata, and, on a process-group gang, what raw
``torch.distributed`` computes from clones of the same inputs on the default group.
The assertions run in ``test_conformance.py``.

It lives at module level, outside the test module, because ``run_world`` starts its
ranks with ``spawn``: they import it by name (``tests/conftest.py`` puts ``tests/support`` on
``sys.path``, and spawned children inherit ``sys.path``).

Inputs are small integers (in float dtypes too) that differ by element and by rank, so
every result is exact and compared with ``torch.equal``; PRODUCT inputs stay within
1..3 so that four ranks cannot overflow ``uint8`` or lose precision in ``bfloat16``.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import torch
import torch.distributed as dist

import agang
from agang import ReduceOp

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INTEGER_DTYPES = (torch.int32, torch.int64, torch.uint8)
ALL_DTYPES = (*FLOAT_DTYPES, *INTEGER_DTYPES, torch.bool, torch.complex64)

# The dtypes each reduce op is defined on: MEAN needs a division, complex numbers are
# not ordered (and c10d multiplies them as pairs of reals, which is wrong).
REDUCE_DTYPES = {
    ReduceOp.SUM: ALL_DTYPES,
    ReduceOp.MEAN: (*FLOAT_DTYPES, torch.complex64),
    ReduceOp.PRODUCT: (*FLOAT_DTYPES, *INTEGER_DTYPES, torch.bool),
    ReduceOp.MIN: (*FLOAT_DTYPES, *INTEGER_DTYPES, torch.bool),
    ReduceOp.MAX: (*FLOAT_DTYPES, *INTEGER_DTYPES, torch.bool),
}

# 1-D, then 2-D, zero elements, 0-dim. Every dtype is tried on the first; the others on
# float32 and on complex64, which c10d sees as pairs of reals (one more dimension).
SHAPES = ((5,), (2, 3), (0,), ())
SHAPE_DTYPES = (torch.float32, torch.complex64)

# What the ranks other than the source pass to broadcast_objects: a list of another
# length than the source's, whose contents must be replaced by the source's.
PLACEHOLDER = ["placeholder"]


@dataclass(frozen=True)
class Case:
    """One step of the program: a collective and its arguments.

    ``shape`` is the shape of the tensor the op works on: the input of the gathers and
    of all_to_all, the output of reduce_scatter and scatter (whose input is ``[size,
    *shape]``), the tensor sent and received around the ring of ``send_recv``.
    ``source_rank`` is the root: broadcast's and scatter's source, reduce's and
    gather's destination. For the uneven ops (``all_to_all_split``,
    ``all_gather_split``) and ``exchange``, ``shape`` is that of one row: the number of
    rows differs by rank (``send_splits``, ``gather_splits``).
    """

    op: str
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()
    reduce_op: ReduceOp | None = None
    source_rank: int | None = None

    def __str__(self) -> str:
        parts = [self.op, str(self.dtype), str(self.shape)]
        if self.reduce_op is not None:
            parts.append(self.reduce_op.name)
        if self.source_rank is not None:
            parts.append(f"from rank {self.source_rank}")
        return " ".join(parts)


@dataclass(kw_only=True)
class Record:
    """What one rank saw when it ran one case."""

    case: Case
    #: What ``await`` returned (for ``send_recv``: what the ``recv`` returned).
    result: Any
    #: What raw torch.distributed computed from clones of the inputs; None without c10d.
    c10d: Any
    #: ``await`` returned what the contract names: the very tensor of an in-place op, the
    #: output of an out-of-place one, the list passed to broadcast_objects, None for
    #: send and barrier.
    awaited_as_documented: bool
    #: An out-of-place op left its input as it was; None for in-place ops.
    input_unchanged: bool | None = None
    #: ``(op, seq, num_bytes)`` of every handle the case issued, in issue order.
    handles: list[tuple[str, int, int]]


def source_ranks(size: int) -> list[int]:
    """The broadcast sources to try: the first, the second and the last rank."""
    return sorted({0, min(1, size - 1), size - 1})


def rooted_cases(root: int) -> list[Case]:
    """A few cases of each rooted collective: its root, a reduce op, dtypes and shapes
    are what differs from the unrooted ones (which try every dtype and shape)."""
    return [
        Case("reduce", torch.float32, (5,), reduce_op=ReduceOp.SUM, source_rank=root),
        Case("reduce", torch.complex64, (2, 3), reduce_op=ReduceOp.MEAN, source_rank=root),
        Case("reduce", torch.int32, (), reduce_op=ReduceOp.MAX, source_rank=root),
        Case("gather", torch.float32, (2, 3), source_rank=root),
        Case("gather", torch.complex64, (), source_rank=root),
        Case("scatter", torch.float32, (2, 3), source_rank=root),
        Case("scatter", torch.bool, (0,), source_rank=root),
    ]


def _tensor_cases(
    op: str,
    dtypes: tuple[torch.dtype, ...],
    shapes: tuple[tuple[int, ...], ...] = SHAPES,
    **arguments: Any,
) -> list[Case]:
    """Every dtype on the first shape, and the other shapes on the SHAPE_DTYPES."""
    first, *others = shapes
    result = [Case(op, dtype, first, **arguments) for dtype in dtypes]
    for shape in others:
        result += [Case(op, dtype, shape, **arguments) for dtype in SHAPE_DTYPES if dtype in dtypes]
    return result


def cases(size: int) -> list[Case]:
    """Every case the program runs on a gang of ``size`` ranks, in order."""
    result: list[Case] = []
    for op in ("all_reduce", "reduce_scatter"):
        for reduce_op, dtypes in REDUCE_DTYPES.items():
            result += _tensor_cases(op, dtypes, reduce_op=reduce_op)
    for op in ("all_gather", "all_gather_to_list", "send_recv"):
        result += _tensor_cases(op, ALL_DTYPES)
    for source in source_ranks(size):
        result += _tensor_cases("broadcast", ALL_DTYPES, source_rank=source)
        result.append(Case("broadcast_objects", source_rank=source))
        result += rooted_cases(source)
    # all_to_all needs a first dimension that is a multiple of the size; no 0-dim.
    result += _tensor_cases("all_to_all", ALL_DTYPES, ((2 * size,), (size, 3), (0,)))
    # Uneven blocks and batched transfers: shapes are the rows' (past the first dimension).
    for op in ("all_to_all_split", "all_gather_split", "exchange"):
        result += [Case(op, dtype, shape) for dtype, shape in UNEVEN_CASES]
    result += [Case("all_gather_objects"), Case("barrier")]
    return result


# The uneven cases: (dtype, shape of one row). Complex goes to c10d as pairs of reals.
UNEVEN_CASES = ((torch.float32, (3,)), (torch.complex64, ()), (torch.uint8, (2, 2)))


def send_splits(rank: int, size: int) -> list[int]:
    """The rows ``rank`` sends each rank in ``all_to_all_split``: 0 to 2, by pair."""
    return [(rank + 2 * peer) % 3 for peer in range(size)]


def receive_splits(rank: int, size: int) -> list[int]:
    """The rows ``rank`` receives from each rank: what each sends it."""
    return [send_splits(peer, size)[rank] for peer in range(size)]


def gather_splits(size: int) -> list[int]:
    """Each rank's rows in ``all_gather_split``: 1, 2, 0, 1, ..."""
    return [(rank + 1) % 3 for rank in range(size)]


def second_input(tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """What ``exchange`` sends to the previous rank (``tensor`` goes to the next)."""
    return make_tensor(tuple(tensor.shape), tensor.dtype, rank + size)


def make_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, rank: int, *, small: bool = False
) -> torch.Tensor:
    """Small integers that differ by element and by rank: -3..3, 0..6 unsigned, 1..3 small."""
    index = torch.arange(math.prod(shape)).reshape(shape)
    values = (index * 5 + rank * 3) % 7
    if dtype is torch.bool:
        return values % 2 == 1
    if small:
        values = values % 3 + 1
    elif dtype.is_signed:
        values = values - 3
    if dtype.is_complex:
        imaginary = (index * 3 + rank * 5) % 7 - 3
        return torch.complex(values.double(), imaginary.double()).to(dtype)
    return values.to(dtype)


def make_objects(rank: int) -> list[Any]:
    """Picklable objects whose pickled length depends on the rank."""
    return [{"rank": rank, "name": "r" * rank}, (rank, 2.5), None, "ü" * (rank + 1)]


def make_input(case: Case, rank: int, size: int) -> Any:
    """What ``rank`` passes to the op of ``case``: a tensor, or objects."""
    if case.op == "broadcast_objects":
        return make_objects(rank) if rank == case.source_rank else list(PLACEHOLDER)
    if case.op == "all_gather_objects":
        return make_objects(rank)
    if case.op == "barrier":
        return None
    assert case.dtype is not None
    shape = (size, *case.shape) if case.op in ("reduce_scatter", "scatter") else case.shape
    if case.op == "all_to_all_split":
        shape = (sum(send_splits(rank, size)), *case.shape)
    elif case.op == "all_gather_split":
        shape = (gather_splits(size)[rank], *case.shape)
    return make_tensor(shape, case.dtype, rank, small=case.reduce_op is ReduceOp.PRODUCT)


def _blank(like: torch.Tensor, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """An output filled with 9, which no input holds (bar True), so an unwritten one shows."""
    return torch.full(like.shape if shape is None else shape, 9, dtype=like.dtype)


def _metadata(handle: agang.Handle[Any]) -> tuple[str, int, int]:
    return handle.op, handle.seq, handle.num_bytes


# The raw torch.distributed reference, on the default process group (agang.init made it).
# It blocks, so it runs in a worker thread. Gloo gathers and scatters flat runs only.

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _c10d_reduce_op(op: ReduceOp) -> dist.ReduceOp.RedOpType:
    # Gloo has no AVG: MEAN is a SUM, divided by the caller.
    return dist.ReduceOp.SUM if op is ReduceOp.MEAN else getattr(dist.ReduceOp, op.name)


def _c10d_all_reduce(tensor: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    dist.all_reduce(tensor, op=_c10d_reduce_op(op))
    if op is ReduceOp.MEAN:
        tensor.div_(dist.get_world_size())
    return tensor


def _c10d_reduce_scatter(input: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    output = _blank(input[0])
    _reduce_scatter_flat(output.view(-1), input.view(-1), op=_c10d_reduce_op(op))
    if op is ReduceOp.MEAN:
        output.div_(dist.get_world_size())
    return output


def _c10d_all_gather(input: torch.Tensor) -> torch.Tensor:
    output = _blank(input, (dist.get_world_size(), *input.shape))
    _all_gather_flat(output.view(-1), input.view(-1))
    return output


def _c10d_all_gather_to_list(input: torch.Tensor) -> list[torch.Tensor]:
    outputs = [_blank(input) for _ in range(dist.get_world_size())]
    dist.all_gather(outputs, input)
    return outputs


def _c10d_reduce(tensor: torch.Tensor, op: ReduceOp, root: int) -> torch.Tensor | None:
    dist.reduce(tensor, root, op=_c10d_reduce_op(op))
    if dist.get_rank() != root:
        return None  # c10d leaves scratch there
    if op is ReduceOp.MEAN:
        tensor.div_(dist.get_world_size())
    return tensor


def _real(tensor: torch.Tensor) -> torch.Tensor:
    # c10d's gather and scatter, unlike its reductions, refuse complex tensors on Gloo
    # ("Invalid scalar type"): they move the same bytes as pairs of reals.
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def _c10d_gather(input: torch.Tensor, root: int) -> torch.Tensor | None:
    if dist.get_rank() != root:
        dist.gather(_real(input), None, root)
        return None
    output = _blank(input, (dist.get_world_size(), *input.shape))
    dist.gather(_real(input), [_real(t) for t in output.unbind(0)], root)
    return output


def _c10d_scatter(input: torch.Tensor, root: int) -> torch.Tensor:
    output = _blank(input[0])
    blocks = [_real(t) for t in input.unbind(0)] if dist.get_rank() == root else None
    dist.scatter(_real(output), blocks, root)
    return output


def _c10d_broadcast(tensor: torch.Tensor, source_rank: int) -> torch.Tensor:
    dist.broadcast(tensor, src=source_rank)
    return tensor


def _c10d_all_to_all(input: torch.Tensor) -> torch.Tensor:
    output = _blank(input)
    dist.all_to_all_single(output, input)
    return output


def _c10d_all_to_all_split(input: torch.Tensor) -> torch.Tensor:
    rank, size = dist.get_rank(), dist.get_world_size()
    output = _blank(input, (sum(receive_splits(rank, size)), *input.shape[1:]))
    dist.all_to_all_single(output, input, receive_splits(rank, size), send_splits(rank, size))
    return output


def _c10d_all_gather_split(input: torch.Tensor) -> torch.Tensor:
    # Gloo's all_gather refuses uneven blocks: the usual way round, padded to the most rows.
    sizes = gather_splits(dist.get_world_size())
    padded = _blank(input, (max(sizes), *input.shape[1:]))
    padded[: input.shape[0]] = input
    gathered = _blank(input, (len(sizes) * max(sizes), *input.shape[1:]))
    _all_gather_flat(_real(gathered), _real(padded))
    blocks = gathered.split(max(sizes))
    return torch.cat([block[:rows] for block, rows in zip(blocks, sizes, strict=True)])


def _c10d_exchange(tensor: torch.Tensor, second: torch.Tensor) -> list[torch.Tensor]:
    rank, size = dist.get_rank(), dist.get_world_size()
    after, before = (rank + 1) % size, (rank - 1) % size
    received = [_blank(tensor), _blank(second)]
    transfers = [(dist.isend, tensor, after), (dist.isend, second, before)]
    transfers += [(dist.irecv, received[0], before), (dist.irecv, received[1], after)]
    ops = [dist.P2POp(op, _real(t), peer) for op, t, peer in transfers]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return received


def _c10d_ring(tensor: torch.Tensor) -> torch.Tensor:
    rank, size = dist.get_rank(), dist.get_world_size()
    received = _blank(tensor)
    for work in (dist.isend(tensor, (rank + 1) % size), dist.irecv(received, (rank - 1) % size)):
        assert work is not None
        work.wait()
    return received


def _c10d_broadcast_objects(objects: list[Any], source_rank: int) -> list[Any]:
    # c10d wants a list of the source's length on every rank, to receive into.
    if dist.get_rank() != source_rank:
        objects = [None] * len(make_objects(source_rank))
    dist.broadcast_object_list(objects, src=source_rank)
    return objects


def _c10d_all_gather_objects(obj: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def _c10d_barrier() -> None:
    dist.barrier()


# One runner per case op: issue on the gang, await, record; then the c10d reference.

C10d = Callable[..., Awaitable[Any]]


async def _out_of_place(
    case: Case,
    handle: agang.Handle[Any],
    output: torch.Tensor | None,
    input: torch.Tensor,
    original: torch.Tensor,
    c10d: C10d,
    *compare: Any,
) -> Record:
    """The record of an out-of-place op: ``handle`` awaited, then what raw c10d gives
    (``c10d(*compare)``, from clones of the inputs)."""
    result = await handle
    return Record(
        case=case,
        result=result,
        c10d=await c10d(*compare),
        awaited_as_documented=result is output,
        input_unchanged=torch.equal(input, original),
        handles=[_metadata(handle)],
    )


async def _all_reduce(gang: agang.Gang, case: Case, tensor: torch.Tensor, c10d: C10d) -> Record:
    assert case.reduce_op is not None
    original = tensor.clone()
    handle = gang.all_reduce(tensor, case.reduce_op)
    result = await handle
    return Record(
        case=case,
        result=result,
        c10d=await c10d(_c10d_all_reduce, original, case.reduce_op),
        awaited_as_documented=result is tensor,
        handles=[_metadata(handle)],
    )


async def _reduce_scatter(gang: agang.Gang, case: Case, input: torch.Tensor, c10d: C10d) -> Record:
    assert case.reduce_op is not None
    original = input.clone()
    output = _blank(input[0])
    handle = gang.reduce_scatter(output, input, case.reduce_op)
    return await _out_of_place(
        case, handle, output, input, original, c10d, _c10d_reduce_scatter, original, case.reduce_op
    )


async def _all_gather(gang: agang.Gang, case: Case, input: torch.Tensor, c10d: C10d) -> Record:
    original = input.clone()
    output = _blank(input, (gang.size, *input.shape))
    handle = gang.all_gather(output, input)
    return await _out_of_place(
        case, handle, output, input, original, c10d, _c10d_all_gather, original
    )


async def _all_gather_to_list(
    gang: agang.Gang, case: Case, input: torch.Tensor, c10d: C10d
) -> Record:
    original = input.clone()
    outputs = [_blank(input) for _ in range(gang.size)]
    handle = gang.all_gather_to_list(outputs, input)
    result = await handle
    return Record(
        case=case,
        result=result,
        c10d=await c10d(_c10d_all_gather_to_list, original),
        awaited_as_documented=[id(t) for t in result] == [id(t) for t in outputs],
        input_unchanged=torch.equal(input, original),
        handles=[_metadata(handle)],
    )


async def _broadcast(gang: agang.Gang, case: Case, tensor: torch.Tensor, c10d: C10d) -> Record:
    assert case.source_rank is not None
    original = tensor.clone()
    handle = gang.broadcast(tensor, case.source_rank)
    result = await handle
    return Record(
        case=case,
        result=result,
        c10d=await c10d(_c10d_broadcast, original, case.source_rank),
        awaited_as_documented=result is tensor,
        handles=[_metadata(handle)],
    )


async def _reduce(gang: agang.Gang, case: Case, tensor: torch.Tensor, c10d: C10d) -> Record:
    """Only the destination's result is recorded: the others' tensor is unspecified."""
    assert case.reduce_op is not None
    assert case.source_rank is not None
    original, root = tensor.clone(), case.source_rank
    handle = gang.reduce(tensor, root, case.reduce_op)
    awaited = await handle
    return Record(
        case=case,
        result=awaited if gang.rank == root else None,
        c10d=await c10d(_c10d_reduce, original, case.reduce_op, root),
        awaited_as_documented=awaited is tensor,
        handles=[_metadata(handle)],
    )


async def _gather(gang: agang.Gang, case: Case, input: torch.Tensor, c10d: C10d) -> Record:
    assert case.source_rank is not None
    original, root = input.clone(), case.source_rank
    output = _blank(input, (gang.size, *input.shape)) if gang.rank == root else None
    handle = gang.gather(output, input, root)
    return await _out_of_place(
        case, handle, output, input, original, c10d, _c10d_gather, original, root
    )


async def _scatter(gang: agang.Gang, case: Case, input: torch.Tensor, c10d: C10d) -> Record:
    """Every rank makes an input; only the source passes it (None elsewhere)."""
    assert case.source_rank is not None
    original, root = input.clone(), case.source_rank
    output = _blank(input[0])
    handle = gang.scatter(output, input if gang.rank == root else None, root)
    return await _out_of_place(
        case, handle, output, input, original, c10d, _c10d_scatter, original, root
    )


async def _all_to_all(gang: agang.Gang, case: Case, input: torch.Tensor, c10d: C10d) -> Record:
    original = input.clone()
    output = _blank(input)
    handle = gang.all_to_all(output, input)
    return await _out_of_place(
        case, handle, output, input, original, c10d, _c10d_all_to_all, original
    )


async def _all_to_all_split(
    gang: agang.Gang, case: Case, input: torch.Tensor, c10d: C10d
) -> Record:
    original = input.clone()
    receives, sends = receive_splits(gang.rank, gang.size), send_splits(gang.rank, gang.size)
    output = _blank(input, (sum(receives), *input.shape[1:]))
    handle = gang.all_to_all(output, input, output_split_sizes=receives, input_split_sizes=sends)
    return await _out_of_place(
        case, handle, output, input, original, c10d, _c10d_all_to_all_split, original
    )


async def _all_gather_split(
    gang: agang.Gang, case: Case, input: torch.Tensor, c10d: C10d
) -> Record:
    original, sizes = input.clone(), gather_splits(gang.size)
    output = _blank(input, (sum(sizes), *input.shape[1:]))
    handle = gang.all_gather(output, input, output_split_sizes=sizes)
    return await _out_of_place(
        case, handle, output, input, original, c10d, _c10d_all_gather_split, original
    )


async def _exchange(gang: agang.Gang, case: Case, tensor: torch.Tensor, c10d: C10d) -> Record:
    """Each rank sends to both neighbours and receives from both, as one batch; with two
    ranks both are the same peer, matched in order."""
    second = second_input(tensor, gang.rank, gang.size)
    originals = [tensor.clone(), second.clone()]
    after, before = (gang.rank + 1) % gang.size, (gang.rank - 1) % gang.size
    received = [_blank(tensor), _blank(second)]
    handle = gang.exchange(
        [(tensor, after), (second, before)], [(received[0], before), (received[1], after)]
    )
    result = await handle
    return Record(
        case=case,
        result=result,
        c10d=await c10d(_c10d_exchange, *originals),
        awaited_as_documented=[id(t) for t in result] == [id(t) for t in received],
        input_unchanged=torch.equal(tensor, originals[0]) and torch.equal(second, originals[1]),
        handles=[_metadata(handle)],
    )


async def _send_recv(gang: agang.Gang, case: Case, tensor: torch.Tensor, c10d: C10d) -> Record:
    """Each rank sends to the next and receives from the previous one (a ring)."""
    original = tensor.clone()
    received = _blank(tensor)
    send = gang.send(tensor, (gang.rank + 1) % gang.size)
    recv = gang.recv(received, (gang.rank - 1) % gang.size)
    await send
    result = await recv
    return Record(
        case=case,
        result=result,
        c10d=await c10d(_c10d_ring, original),
        awaited_as_documented=send.result() is None and result is received,
        input_unchanged=torch.equal(tensor, original),
        handles=[_metadata(send), _metadata(recv)],
    )


async def _broadcast_objects(
    gang: agang.Gang, case: Case, objects: list[Any], c10d: C10d
) -> Record:
    assert case.source_rank is not None
    original = list(objects)
    handle = gang.broadcast_objects(objects, case.source_rank)
    result = await handle
    return Record(
        case=case,
        result=result,
        c10d=await c10d(_c10d_broadcast_objects, original, case.source_rank),
        awaited_as_documented=result is objects,
        handles=[_metadata(handle)],
    )


async def _all_gather_objects(gang: agang.Gang, case: Case, obj: Any, c10d: C10d) -> Record:
    handle = gang.all_gather_objects(obj)
    result = await handle
    return Record(
        case=case,
        result=result,
        c10d=await c10d(_c10d_all_gather_objects, obj),
        awaited_as_documented=isinstance(result, list),
        handles=[_metadata(handle)],
    )


async def _barrier(gang: agang.Gang, case: Case, _: None, c10d: C10d) -> Record:
    handle = gang.barrier()
    await handle
    return Record(
        case=case,
        result=handle.result(),
        c10d=await c10d(_c10d_barrier),
        awaited_as_documented=handle.result() is None,
        handles=[_metadata(handle)],
    )


_RUNNERS: dict[str, Callable[[agang.Gang, Case, Any, C10d], Awaitable[Record]]] = {
    "all_reduce": _all_reduce,
    "reduce_scatter": _reduce_scatter,
    "all_gather": _all_gather,
    "all_gather_to_list": _all_gather_to_list,
    "broadcast": _broadcast,
    "all_to_all": _all_to_all,
    "reduce": _reduce,
    "gather": _gather,
    "scatter": _scatter,
    "send_recv": _send_recv,
    "all_to_all_split": _all_to_all_split,
    "all_gather_split": _all_gather_split,
    "exchange": _exchange,
    "broadcast_objects": _broadcast_objects,
    "all_gather_objects": _all_gather_objects,
    "barrier": _barrier,
}


async def _in_thread(function: Callable[..., Any], *args: Any) -> Any:
    return await anyio.to_thread.run_sync(function, *args)


async def _skip(function: Callable[..., Any], *args: Any) -> None:
    return None


async def run_cases(gang: agang.Gang, selected: list[Case]) -> list[Record]:
    """Runs ``selected`` in order on ``gang``; c10d's reference too on a process group."""
    c10d: C10d = _in_thread if isinstance(gang, agang.ProcessGroupGang) else _skip
    records = []
    for case in selected:
        value = make_input(case, gang.rank, gang.size)
        records.append(await _RUNNERS[case.op](gang, case, value, c10d))
    return records


async def run_conformance(gang: agang.Gang) -> list[Record]:
    """The whole program: every case of :func:`cases` for the gang's size."""
    return await run_cases(gang, cases(gang.size))
