"""One conformance program, run against every Gang implementation.

The program (``conformance_program.py``) calls every collective of the Gang interface
with every reduce op and several dtypes and shapes, and records what each rank saw. The
tests here check every rank's records against a plain reference computed from all ranks'
inputs, and on real Gloo ranks also against raw torch.distributed on the same inputs:

- the results, exactly (``torch.equal``, dtype and shape included);
- ``await`` returns the tensor of an in-place op and the output of an out-of-place one;
- out-of-place ops (reduce_scatter, the gathers, scatter, all_to_all, send) leave their
  input be;
- each handle's ``op`` and ``num_bytes``, and ``seq`` numbers consecutive from 0.

FakeGang plays every rank as a copy of itself, so its reference is the same one computed
from ``size`` copies of its own input.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from conformance_program import (
    Case,
    Record,
    cases,
    gather_splits,
    make_input,
    receive_splits,
    run_cases,
    run_conformance,
    second_input,
    send_splits,
)

import agang
from agang import ReduceOp
from agang._collective.serialize import encode
from agang.testing import FakeWorld, run_world

SIZES = (2, 3, 4)
ROOTED = ("reduce", "gather", "scatter")
# FakeGang's ranks are copies of one: no blocks that differ by rank, no peers.
UNEVEN = ("all_to_all_split", "all_gather_split", "exchange")

# Every async backend on 2 ranks, then one each for 3 and 4: each run_world costs seconds.
GLOO_RUNS = [(2, "asyncio"), (2, "uvloop"), (2, "trio"), (3, "trio"), (4, "uvloop")]


# The reference: what each rank should see, from every rank's input.


def reduce(tensors: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """The reduction of ``tensors`` by ``op``, in their dtype (on bool: or / and)."""
    stacked = torch.stack(tensors)
    if op is ReduceOp.SUM:
        result = stacked.sum(0)
    elif op is ReduceOp.MEAN:
        result = stacked.sum(0) / len(tensors)
    elif op is ReduceOp.PRODUCT:
        result = stacked.prod(0)
    elif op is ReduceOp.MIN:
        result = stacked.amin(0)
    else:
        result = stacked.amax(0)
    return result.to(stacked.dtype)


def expected_results(case: Case, inputs: list[Any]) -> list[Any]:
    """What ``await`` returns on each rank, given each rank's input."""
    size = len(inputs)
    ranks = range(size)
    if case.op == "all_reduce":
        assert case.reduce_op is not None
        return [reduce(inputs, case.reduce_op)] * size
    if case.op == "reduce_scatter":
        assert case.reduce_op is not None
        return [reduce([chunks[rank] for chunks in inputs], case.reduce_op) for rank in ranks]
    if case.op == "all_gather":
        return [torch.stack(inputs)] * size
    if case.op in ("all_gather_to_list", "all_gather_objects"):
        return [list(inputs)] * size
    if case.op in ("broadcast", "broadcast_objects"):
        assert case.source_rank is not None
        return [inputs[case.source_rank]] * size
    if case.op in ROOTED:
        return expected_rooted(case, inputs)
    if case.op == "all_to_all":
        # Chunk j of rank i's input lands in chunk i of rank j's output.
        return [torch.cat([x.tensor_split(size)[rank] for x in inputs]) for rank in ranks]
    if case.op == "send_recv":
        return [inputs[(rank - 1) % size] for rank in ranks]
    if case.op in UNEVEN:
        return expected_uneven(case, inputs)
    assert case.op == "barrier"
    return [None] * size


def expected_rooted(case: Case, inputs: list[Any]) -> list[Any]:
    """reduce and gather: the result on the root, None elsewhere (a reduce's other
    tensors are unspecified and not recorded); scatter: the root's r-th block on rank r."""
    root = case.source_rank
    assert root is not None
    ranks = range(len(inputs))
    if case.op == "scatter":
        return [inputs[root][rank] for rank in ranks]
    if case.op == "reduce":
        assert case.reduce_op is not None
        result = reduce(inputs, case.reduce_op)
    else:
        result = torch.stack(inputs)
    return [result if rank == root else None for rank in ranks]


def expected_uneven(case: Case, inputs: list[Any]) -> list[Any]:
    """The uneven blocks' results, from each rank's rows, and exchange's pair of
    receives (from the previous rank's first input, from the next rank's second)."""
    size = len(inputs)
    ranks = range(size)
    if case.op == "all_gather_split":
        return [torch.cat(inputs)] * size
    if case.op == "all_to_all_split":
        blocks = [x.split(send_splits(rank, size)) for rank, x in enumerate(inputs)]
        return [torch.cat([sent[rank] for sent in blocks]) for rank in ranks]
    after = [second_input(x, rank, size) for rank, x in enumerate(inputs)]
    return [[inputs[(rank - 1) % size], after[(rank + 1) % size]] for rank in ranks]


def num_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def expected_handles(case: Case, rank: int, inputs: list[Any]) -> list[tuple[str, int]]:
    """``(op, num_bytes)`` of the handles ``rank`` issues: the bytes of its tensors."""
    size = len(inputs)
    mine = inputs[rank]
    if case.op in ("all_reduce", "broadcast", "reduce"):
        return [(case.op, num_bytes(mine))]
    if case.op in ("gather", "scatter"):  # the root's blocks count on the root only
        part = num_bytes(mine) if case.op == "gather" else num_bytes(mine) // size
        return [(case.op, part * (size + 1 if rank == case.source_rank else 1))]
    if case.op == "reduce_scatter":  # the input, and an output of one chunk of it
        return [(case.op, num_bytes(mine) + num_bytes(mine) // size)]
    if case.op in ("all_gather", "all_gather_to_list"):  # the input, and size copies
        return [(case.op, (size + 1) * num_bytes(mine))]
    if case.op == "all_to_all":
        return [(case.op, 2 * num_bytes(mine))]
    if case.op == "exchange":  # two sends and two receives of one shape
        return [("exchange", 4 * num_bytes(mine))]
    if case.op in UNEVEN:  # the input, and an output of the rows received
        row = num_bytes(torch.empty(case.shape, dtype=case.dtype))
        splits = (
            receive_splits(rank, size) if case.op == "all_to_all_split" else gather_splits(size)
        )
        return [(case.op.removesuffix("_split"), num_bytes(mine) + sum(splits) * row)]
    if case.op == "send_recv":
        return [("send", num_bytes(mine)), ("recv", num_bytes(mine))]
    if case.op == "barrier":
        return [("barrier", 0)]
    # The object collectives count the encoded bytes this rank sends (in the default, safe
    # format): none on a receiver.
    sends = case.op == "all_gather_objects" or rank == case.source_rank
    payload = len(b"".join(encode(mine, "safe", name="obj"))) if sends else 0
    return [(case.op, payload)]


# Checking records.


def same(actual: Any, expected: Any) -> bool:
    """Exact equality: tensors of one dtype and shape with equal values, element-wise."""
    if isinstance(expected, torch.Tensor):
        return (
            isinstance(actual, torch.Tensor)
            and actual.dtype == expected.dtype
            and actual.shape == expected.shape
            and torch.equal(actual, expected)
        )
    if isinstance(expected, list | tuple) and any(isinstance(x, torch.Tensor) for x in expected):
        return (
            isinstance(actual, list | tuple)
            and len(actual) == len(expected)
            and all(same(a, e) for a, e in zip(actual, expected, strict=True))
        )
    return bool(actual == expected)


def problems(
    record: Record,
    rank: int,
    expected: Any,
    handles: list[tuple[str, int]],
    *,
    with_c10d: bool,
) -> list[str]:
    """What is wrong with one rank's record of one case, as readable lines."""
    where = f"rank {rank}, {record.case}"
    found = []
    if not same(record.result, expected):
        found.append(f"{where}: got {record.result!r}, expected {expected!r}")
    if with_c10d and not same(record.result, record.c10d):
        found.append(f"{where}: got {record.result!r}, but c10d computes {record.c10d!r}")
    if not record.awaited_as_documented:
        found.append(f"{where}: `await` did not return the documented object")
    if record.input_unchanged is False:
        found.append(f"{where}: the op wrote into its input")
    metadata = [(op, size) for op, _, size in record.handles]
    if metadata != handles:
        found.append(f"{where}: handles (op, num_bytes) are {metadata}, expected {handles}")
    return found


def check_sequence(records: list[Record]) -> None:
    """Every handle of a fresh gang is numbered in issue order, from 0, without gaps."""
    seqs = [seq for record in records for _, seq, _ in record.handles]
    assert seqs == list(range(len(seqs)))


def check_world(records: list[list[Record]], *, with_c10d: bool) -> None:
    """Checks every rank's records of the whole program against the reference."""
    size = len(records)
    program = cases(size)
    for rank_records in records:
        assert [record.case for record in rank_records] == program
        check_sequence(rank_records)
    found = []
    for index, case in enumerate(program):
        inputs = [make_input(case, rank, size) for rank in range(size)]
        expected = expected_results(case, inputs)
        for rank in range(size):
            handles = expected_handles(case, rank, inputs)
            record = records[rank][index]
            found += problems(record, rank, expected[rank], handles, with_c10d=with_c10d)
    assert not found, f"{len(found)} problems:\n" + "\n".join(found)


# Every implementation against the reference.


@pytest.mark.anyio
@pytest.mark.parametrize("size", SIZES)
async def test_fake_world_conforms(size: int) -> None:
    records = await FakeWorld(size).run(run_conformance)

    check_world(records, with_c10d=False)


@pytest.mark.gloo
@pytest.mark.parametrize(("size", "async_backend"), GLOO_RUNS)
def test_gloo_conforms_and_matches_c10d(size: int, async_backend: str) -> None:
    records = run_world(run_conformance, size, async_backend=async_backend)

    check_world(records, with_c10d=True)


@pytest.mark.anyio
@pytest.mark.parametrize(("rank", "size"), [(0, 1), (2, 3), (1, 4)])
async def test_fake_gang_conforms_as_copies_of_one_rank(rank: int, size: int) -> None:
    gang = agang.FakeGang(rank=rank, size=size)
    # A rooted op computes on its root only: there, this rank's copies are every rank.
    program = [
        dataclasses.replace(case, source_rank=rank) if case.op in ROOTED else case
        for case in cases(size)
        if case.op != "send_recv" and case.op not in UNEVEN
    ]

    records = await run_cases(gang, program)

    check_sequence(records)
    found = []
    for record in records:
        mine = make_input(record.case, rank, size)
        # Every rank holds this rank's input, and any source rank is a copy of this one.
        copies = [mine] * size
        case = dataclasses.replace(record.case, source_rank=rank)
        expected = expected_results(case, copies)[rank]
        handles = expected_handles(case, rank, copies)
        found += problems(record, rank, expected, handles, with_c10d=False)
    assert not found, f"{len(found)} problems:\n" + "\n".join(found)


# FakeGang's semantics, spelled out (fairseq2's FakeGang).


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("op", "expected"),
    [
        (ReduceOp.SUM, [4.0, -8.0, 12.0]),  # times the size
        (ReduceOp.PRODUCT, [1.0, 16.0, 81.0]),  # to the power of the size
        (ReduceOp.MEAN, [1.0, -2.0, 3.0]),
        (ReduceOp.MIN, [1.0, -2.0, 3.0]),
        (ReduceOp.MAX, [1.0, -2.0, 3.0]),
    ],
)
async def test_fake_gang_reduces_size_copies_of_the_input(
    op: ReduceOp, expected: list[float]
) -> None:
    gang = agang.FakeGang(rank=1, size=4)
    tensor = torch.tensor([1.0, -2.0, 3.0])

    assert (await gang.all_reduce(tensor, op)).tolist() == expected
    output = torch.empty(3)
    inputs = torch.tensor([[0.0, 0.0, 0.0], [1.0, -2.0, 3.0], [0.0, 0.0, 0.0], [0.0] * 3])
    assert (await gang.reduce_scatter(output, inputs, op)).tolist() == expected


@pytest.mark.anyio
async def test_fake_gang_gathers_repeat_the_input() -> None:
    gang = agang.FakeGang(rank=2, size=3)
    tensor = torch.tensor([1, 2])

    gathered = await gang.all_gather(torch.empty(3, 2, dtype=torch.int64), tensor)
    listed = await gang.all_gather_to_list(
        [torch.empty(2, dtype=torch.int64) for _ in range(3)], tensor
    )
    objects = await gang.all_gather_objects({"rank": 2})

    assert gathered.tolist() == [[1, 2]] * 3
    assert [t.tolist() for t in listed] == [[1, 2]] * 3
    assert objects == [{"rank": 2}] * 3


def test_fake_gang_refuses_send_and_recv_when_called() -> None:
    gang = agang.FakeGang(rank=0, size=2)

    with pytest.raises(agang.GangError, match="cannot send or receive"):
        _ = gang.send(torch.ones(2), destination_rank=1)
    with pytest.raises(agang.GangError, match="cannot send or receive"):
        _ = gang.recv(torch.ones(2), source_rank=1)

    assert gang.statistics().num_issued == 0
    handle = gang.barrier()
    assert handle.seq == 0
    assert handle.done()
