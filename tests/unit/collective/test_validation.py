"""Bad local input is refused before anything is issued (fault scenarios D*).

Every refusal must raise ``TypeError``/``ValueError`` (or an agang error) whose message
names the parameter in backticks, and must change nothing: the gang still works and the
refused call took no sequence number, so the ranks stay in step.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import agang
from agang import ReduceOp
from agang.testing import FakeWorld

pytestmark = pytest.mark.anyio

SIZE = 3
RANK = 0  # the rank that makes the bad call

COLLECTIVES = [
    "all_reduce",
    "all_gather",
    "all_gather_to_list",
    "reduce_scatter",
    "broadcast",
    "broadcast_objects",
    "all_gather_objects",
    "all_to_all",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    "exchange",
    "barrier",
]


def valid_arguments(collective: str, rank: int, size: int) -> dict[str, Any]:
    """Fresh keyword arguments with which rank ``rank`` of a gang may call ``collective``.

    Every rank of a gang calling its collective with these arguments completes it (send
    goes to the next rank, recv comes from the previous one).
    """
    match collective:
        case "all_reduce" | "broadcast":
            return {"tensor": torch.ones(4)}
        case "all_gather":
            return {"output": torch.empty(size, 4), "input": torch.ones(4)}
        case "all_gather_to_list":
            return {"outputs": [torch.empty(4) for _ in range(size)], "input": torch.ones(4)}
        case "reduce_scatter":
            return {"output": torch.empty(4), "input": torch.ones(size, 4)}
        case "broadcast_objects":
            return {"objects": [f"from rank {rank}"]}
        case "all_gather_objects":
            return {"obj": {"rank": rank}}
        case "all_to_all":
            return {"output": torch.empty(2 * size), "input": torch.ones(2 * size)}
        case "reduce":  # rank 0 is the root of the rooted collectives
            return {"tensor": torch.ones(4), "destination_rank": 0}
        case "gather":
            output = torch.empty(size, 4) if rank == 0 else None
            return {"output": output, "input": torch.ones(4), "destination_rank": 0}
        case "scatter":
            input = torch.ones(size, 4) if rank == 0 else None
            return {"output": torch.empty(4), "input": input, "source_rank": 0}
        case "send":
            return {"tensor": torch.ones(4), "destination_rank": (rank + 1) % size}
        case "recv":
            return {"tensor": torch.empty(4), "source_rank": (rank - 1) % size}
        case "exchange":  # around the ring, both ways
            after, before = (rank + 1) % size, (rank - 1) % size
            sends = [(torch.ones(4), after), (torch.ones(2), before)]
            return {"sends": sends, "recvs": [(torch.empty(4), before), (torch.empty(2), after)]}
        case "barrier":
            return {}
    raise AssertionError(collective)


Arguments = Callable[[str, int, int], dict[str, Any]]


def call(
    gang: agang.Gang, collective: str, arguments: Arguments = valid_arguments, **replaced: Any
) -> agang.Handle[Any]:
    """Calls ``collective`` on ``gang`` with ``arguments``, some of them replaced."""
    keywords = arguments(collective, gang.rank, gang.size) | replaced
    return getattr(gang, collective)(**keywords)  # type: ignore[no-any-return]


def ops_per_round(collective: str) -> int:
    """How many ops :func:`run_everywhere` issues on each rank for ``collective``."""
    return 2 if collective in ("send", "recv") else 1


async def run_everywhere(
    world: FakeWorld, collective: str, arguments: Arguments = valid_arguments
) -> list[agang.Handle[Any]]:
    """Issues ``collective`` on every rank and awaits it; returns the ranks' handles.

    A send or recv is paired with its counterpart around a ring, issued after it.
    """
    handles = [call(gang, collective, arguments) for gang in world]
    counterpart = {"send": "recv", "recv": "send"}.get(collective)
    others = [call(gang, counterpart, arguments) for gang in world] if counterpart else []
    for handle in handles + others:
        await handle
    return handles


# Bad tensors, each made from the valid one it replaces.


def non_contiguous(valid: torch.Tensor) -> torch.Tensor:
    wide = torch.ones(*valid.shape[:-1], 2 * valid.shape[-1])
    bad = wide[..., ::2]
    assert bad.shape == valid.shape
    assert not bad.is_contiguous()
    return bad


def int16(valid: torch.Tensor) -> torch.Tensor:
    return valid.to(torch.int16)  # Gloo refuses int16, and so do the fakes


def on_meta_device(valid: torch.Tensor) -> torch.Tensor:
    return torch.empty(valid.shape, device="meta")


def sparse(valid: torch.Tensor) -> torch.Tensor:
    return valid.to_sparse()


def not_a_tensor(valid: torch.Tensor) -> Any:
    return valid.tolist()


def lazily_conjugated(valid: torch.Tensor) -> torch.Tensor:
    # Complex, as only a complex tensor carries the flag; its memory holds the values
    # before conjugation. Gloo fails such a tensor once issued, breaking the gang.
    bad = valid.to(torch.complex64).conj()
    assert bad.is_conj()
    assert bad.is_contiguous()
    return bad


def lazily_negated(valid: torch.Tensor) -> torch.Tensor:
    # What torch makes of `x.conj().imag`, contiguous; its memory holds `valid`'s values,
    # which Gloo reduces un-negated, giving a wrong result and no error.
    bad = torch._neg_view(valid)
    assert bad.is_neg()
    assert bad.is_contiguous()
    return bad


BAD_TENSORS: list[tuple[Callable[[torch.Tensor], Any], type[Exception]]] = [
    (non_contiguous, ValueError),
    (int16, TypeError),
    (on_meta_device, ValueError),
    (sparse, TypeError),
    (not_a_tensor, TypeError),
    (lazily_conjugated, ValueError),
    (lazily_negated, ValueError),
]

TENSOR_PARAMETERS = [
    ("all_reduce", "tensor"),
    ("all_gather", "output"),
    ("all_gather", "input"),
    ("all_gather_to_list", "input"),
    ("reduce_scatter", "output"),
    ("reduce_scatter", "input"),
    ("broadcast", "tensor"),
    ("all_to_all", "output"),
    ("all_to_all", "input"),
    ("reduce", "tensor"),
    ("gather", "output"),
    ("gather", "input"),
    ("scatter", "output"),
    ("scatter", "input"),
    ("send", "tensor"),
    ("recv", "tensor"),
]

# exchange's tensors are named by their place in its lists: `sends[1][0]`, `recvs[0][0]`.
EXCHANGE_TENSORS = [("sends", 1), ("recvs", 0)]


def bad_tensor_cases() -> list[Any]:
    cases = []
    for collective, parameter in TENSOR_PARAMETERS:
        for make_bad, error in BAD_TENSORS:

            def bad_call(
                gang: agang.Gang,
                collective: str = collective,
                parameter: str = parameter,
                make_bad: Callable[[torch.Tensor], Any] = make_bad,
            ) -> object:
                valid = valid_arguments(collective, gang.rank, gang.size)[parameter]
                return call(gang, collective, **{parameter: make_bad(valid)})

            cases.append(
                pytest.param(
                    collective,
                    bad_call,
                    error,
                    parameter,
                    id=f"{collective}-{parameter}-{make_bad.__name__}",
                )
            )
    for (name, index), (make_bad, error) in itertools.product(EXCHANGE_TENSORS, BAD_TENSORS):

        def bad_transfer(
            gang: agang.Gang,
            name: str = name,
            index: int = index,
            make_bad: Callable[[torch.Tensor], Any] = make_bad,
        ) -> object:
            transfers = valid_arguments("exchange", gang.rank, gang.size)[name]
            tensor, rank = transfers[index]
            transfers[index] = (make_bad(tensor), rank)
            return call(gang, "exchange", **{name: transfers})

        parameter = f"{name}[{index}][0]"
        cases.append(
            pytest.param(
                "exchange",
                bad_transfer,
                error,
                parameter,
                id=f"exchange-{parameter}-{make_bad.__name__}",
            )
        )
    for make_bad, error in BAD_TENSORS:
        # One element of the outputs list is bad, the others are fine.

        def bad_element(
            gang: agang.Gang, make_bad: Callable[[torch.Tensor], Any] = make_bad
        ) -> object:
            outputs: list[Any] = [torch.empty(4) for _ in range(gang.size)]
            outputs[1] = make_bad(outputs[1])
            return gang.all_gather_to_list(outputs, torch.ones(4))

        cases.append(
            pytest.param(
                "all_gather_to_list",
                bad_element,
                error,
                "outputs[1]",
                id=f"all_gather_to_list-outputs[1]-{make_bad.__name__}",
            )
        )
    return cases


def case(
    collective: str, error: type[Exception], parameter: str, *, id: str, **replaced: Any
) -> Any:
    """A bad call of ``collective``: valid arguments except ``replaced``."""

    def bad_call(gang: agang.Gang) -> object:
        return call(gang, collective, **replaced)

    return pytest.param(collective, bad_call, error, parameter, id=f"{collective}-{id}")


SHAPE_CASES = [
    case("all_gather", ValueError, "output", id="output-one-row-short", output=torch.empty(2, 4)),
    # Flat, [SIZE * 4], is the concatenated layout (accepted); one element more is neither.
    case(
        "all_gather",
        ValueError,
        "output",
        id="output-neither-layout",
        output=torch.empty(SIZE * 4 + 1),
    ),
    case(
        "all_gather",
        TypeError,
        "output",
        id="output-other-dtype",
        output=torch.empty(SIZE, 4, dtype=torch.float64),
    ),
    case(
        "all_gather_to_list",
        ValueError,
        "outputs",
        id="outputs-too-short",
        outputs=[torch.empty(4) for _ in range(SIZE - 1)],
    ),
    case(
        "all_gather_to_list",
        ValueError,
        "outputs",
        id="outputs-too-long",
        outputs=[torch.empty(4) for _ in range(SIZE + 1)],
    ),
    case(
        "all_gather_to_list", TypeError, "outputs", id="outputs-a-tensor", outputs=torch.empty(3, 4)
    ),
    case(
        "all_gather_to_list",
        ValueError,
        "outputs[2]",
        id="outputs[2]-wrong-shape",
        outputs=[torch.empty(4), torch.empty(4), torch.empty(5)],
    ),
    case("reduce_scatter", ValueError, "input", id="input-one-row-short", input=torch.ones(2, 4)),
    # The input's shape is derived from the output's, so a mismatch names `input`.
    case("reduce_scatter", ValueError, "input", id="output-too-long", output=torch.empty(5)),
    case(
        "reduce_scatter",
        TypeError,
        "output",
        id="output-other-dtype",
        output=torch.empty(4, dtype=torch.float64),
    ),
    case("all_to_all", ValueError, "output", id="output-other-shape", output=torch.empty(8)),
    case(
        "all_to_all",
        ValueError,
        "input",
        id="input-not-a-multiple-of-size",
        output=torch.empty(SIZE + 1),
        input=torch.ones(SIZE + 1),
    ),
    case(
        "all_to_all",
        ValueError,
        "input",
        id="input-zero-dim",
        output=torch.tensor(1.0),
        input=torch.tensor(1.0),
    ),
]

# Uneven blocks (SIZE = 3, rank RANK = 0; the valid even call moves 6 rows of 1).
UNEVEN_CASES = [
    case(
        "all_to_all",
        TypeError,
        "input_split_sizes",
        id="input-split-sizes-a-tensor",
        input_split_sizes=torch.tensor([2, 2, 2]),
    ),
    case(
        "all_to_all",
        ValueError,
        "input_split_sizes",
        id="input-split-sizes-too-short",
        input_split_sizes=[3, 3],
    ),
    case(
        "all_to_all",
        TypeError,
        "output_split_sizes",
        id="output-split-sizes-float",
        output_split_sizes=[2.0, 2, 2],
    ),
    case(
        "all_to_all",
        ValueError,
        "output_split_sizes",
        id="output-split-sizes-negative",
        output_split_sizes=[2, 5, -1],
    ),
    case(
        "all_to_all",
        ValueError,
        "input",
        id="input-rows-not-the-sum",
        input_split_sizes=[2, 2, 1],
        output_split_sizes=[2, 2, 2],
    ),
    case(
        "all_to_all",
        ValueError,
        "output",
        id="output-rows-not-the-sum",
        input_split_sizes=[2, 2, 2],
        output_split_sizes=[2, 2, 3],
    ),
    # The missing sizes mean equal blocks, of a tensor whose rows are not a multiple.
    case(
        "all_to_all",
        ValueError,
        "output",
        id="output-not-a-multiple-without-sizes",
        output=torch.empty(7),
        input_split_sizes=[2, 2, 2],
    ),
    case(
        "all_to_all",
        ValueError,
        "output_split_sizes",
        id="block-to-itself-disagrees",
        input_split_sizes=[1, 3, 2],
        output_split_sizes=[2, 2, 2],
    ),
    case(
        "all_to_all",
        ValueError,
        "output",
        id="output-other-rows",
        output=torch.empty(6, 2),
        input_split_sizes=[2, 2, 2],
        output_split_sizes=[2, 2, 2],
    ),
    case(
        "all_gather",
        ValueError,
        "output_split_sizes",
        id="output-split-sizes-too-long",
        output_split_sizes=[1, 1, 1, 1],
    ),
    case("all_gather", TypeError, "output_split_sizes", id="sizes-a-str", output_split_sizes="1"),
    case(
        "all_gather",
        ValueError,
        "input",
        id="input-rows-not-this-ranks-size",
        output=torch.empty(6, 4),
        input=torch.ones(1, 4),
        output_split_sizes=[2, 2, 2],
    ),
    case(
        "all_gather",
        ValueError,
        "output",
        id="output-rows-not-the-sum",
        output=torch.empty(5, 4),
        input=torch.ones(2, 4),
        output_split_sizes=[2, 2, 2],
    ),
    case(
        "all_gather",
        ValueError,
        "output",
        id="output-other-rows",
        output=torch.empty(6, 3),
        input=torch.ones(2, 4),
        output_split_sizes=[2, 2, 2],
    ),
]

EXCHANGE_CASES = [
    case("exchange", ValueError, "sends", id="nothing", sends=[], recvs=()),
    case("exchange", TypeError, "sends", id="sends-a-tensor", sends=torch.ones(4)),
    case("exchange", TypeError, "recvs[0]", id="recvs-not-pairs", recvs=[torch.ones(4)]),
    case("exchange", ValueError, "sends[0][1]", id="to-self", sends=[(torch.ones(4), RANK)]),
    case("exchange", ValueError, "recvs[0][1]", id="too-big", recvs=[(torch.ones(4), SIZE)]),
    case("exchange", TypeError, "sends[0][1]", id="rank-float", sends=[(torch.ones(4), 1.0)]),
]


def test_an_exchange_refuses_receives_that_overlap() -> None:
    gang = FakeWorld(SIZE)[RANK]
    buffer, other = torch.zeros(8), torch.ones(4)

    with pytest.raises(ValueError, match=re.escape("`recvs[1][0]` must not overlap")):
        gang.exchange([], [(other, 1), (other, 2)])
    with pytest.raises(ValueError, match=re.escape("`recvs[0][0]` must not overlap")):
        gang.exchange([(other, 1)], [(other, 2)])
    with pytest.raises(ValueError, match=re.escape("`recvs[0][0]` must not overlap")):
        gang.exchange([(buffer[:4], 1)], [(buffer[2:6], 2)])
    with pytest.raises(ValueError, match=re.escape("`recvs[1][0]` must not overlap")):
        gang.exchange([], [(buffer[:4], 1), (buffer[3:], 2)])
    with pytest.raises(ValueError, match=re.escape("`recvs[0][0]` must not overlap")):
        gang.exchange([(buffer, 1), (other, 2)], [(buffer[5:7], 2)])
    assert gang.statistics().num_issued == 0


def overlapping_all_to_all(layout: str) -> dict[str, Any]:
    """An all_to_all's arguments on SIZE ranks whose `output` shares memory with `input`."""
    buffer = torch.arange(4.0 * SIZE)
    match layout:
        case "in-place":
            return {"output": buffer[: 2 * SIZE], "input": buffer[: 2 * SIZE]}
        case "in-place-uneven":
            sizes = [2] * SIZE
            return {
                "output": buffer[: 2 * SIZE],
                "input": buffer[: 2 * SIZE],
                "output_split_sizes": sizes,
                "input_split_sizes": sizes,
            }
        case "shifted-by-a-row":
            rows = buffer.view(-1, 2)
            return {"output": rows[1 : SIZE + 1], "input": rows[:SIZE]}
        case "shifted-back-a-row":
            rows = buffer.view(-1, 2)
            return {"output": rows[:SIZE], "input": rows[1 : SIZE + 1]}
    raise AssertionError(layout)


OVERLAPS = ["in-place", "in-place-uneven", "shifted-by-a-row", "shifted-back-a-row"]


def ranks_that_start_all_to_all(world: FakeWorld) -> list[int]:
    """A list to which each rank's backend adds its rank when it starts an all_to_all:
    what reaches the backend, past every check of the gang's."""
    started: list[int] = []
    for gang in world:
        backend: Any = gang._backend  # type: ignore[attr-defined]
        start = backend.start_all_to_all

        def counted(*args: Any, start: Any = start, rank: int = gang.rank, **kwargs: Any) -> None:
            started.append(rank)
            start(*args, **kwargs)

        backend.start_all_to_all = counted
    return started


@pytest.mark.parametrize("layout", OVERLAPS)
async def test_an_all_to_all_refuses_output_that_overlaps_input(layout: str) -> None:
    # On Gloo such a call gives some ranks rows already overwritten, and no error.
    world = FakeWorld(SIZE)
    started = ranks_that_start_all_to_all(world)

    for gang in world:  # every rank refuses the same call, as each checks it alone
        with pytest.raises(
            ValueError, match=re.escape("`output` must not overlap `input` in memory")
        ):
            gang.all_to_all(**overlapping_all_to_all(layout))

    assert started == []
    assert [gang.statistics().num_issued for gang in world] == [0] * SIZE
    handles = await run_everywhere(world, "all_to_all")  # the ranks are still in step
    assert [h.seq for h in handles] == [0] * SIZE
    assert sorted(started) == list(range(SIZE))


@pytest.mark.parametrize("layout", OVERLAPS)
def test_fake_gang_refuses_an_all_to_all_whose_output_overlaps_input(layout: str) -> None:
    gang = agang.FakeGang(rank=RANK, size=SIZE)

    with pytest.raises(ValueError, match=re.escape("`output` must not overlap `input` in memory")):
        gang.all_to_all(**overlapping_all_to_all(layout))

    assert gang.statistics().num_issued == 0
    assert call(gang, "all_to_all").wait(timeout=10) is not None


async def test_an_all_to_all_takes_two_halves_of_one_buffer() -> None:
    # Views of one storage that do not overlap are separate buffers.
    world = FakeWorld(SIZE)
    buffers = [
        torch.cat([torch.arange(2.0 * SIZE) + 10 * rank, torch.zeros(2 * SIZE)])
        for rank in range(SIZE)
    ]

    handles = [
        gang.all_to_all(buffer[2 * SIZE :], buffer[: 2 * SIZE])
        for gang, buffer in zip(world, buffers, strict=True)
    ]

    for rank, handle in enumerate(handles):
        received = await handle
        expected = [10 * peer + 2 * rank + i for peer in range(SIZE) for i in range(2)]
        assert received.tolist() == expected


ROOTED_SHAPE_CASES = [
    case("gather", ValueError, "output", id="output-one-row-short", output=torch.empty(2, 4)),
    case(
        "gather",
        TypeError,
        "output",
        id="output-other-dtype",
        output=torch.empty(SIZE, 4, dtype=torch.float64),
    ),
    case("scatter", ValueError, "input", id="input-one-row-short", input=torch.ones(2, 4)),
    case("scatter", ValueError, "input", id="output-too-long", output=torch.empty(5)),
    case(
        "scatter",
        TypeError,
        "output",
        id="output-other-dtype",
        output=torch.empty(4, dtype=torch.int64),
    ),
]

# The bad rank (RANK) is the root of the valid calls: it must pass the root's tensor,
# and must not pass it when it names another root.
ROOT_CASES = [
    case("reduce", ValueError, "destination_rank", id="too-big", destination_rank=SIZE),
    case("reduce", TypeError, "destination_rank", id="bool", destination_rank=False),
    case("gather", ValueError, "destination_rank", id="negative", destination_rank=-1),
    case("gather", TypeError, "destination_rank", id="none", destination_rank=None),
    case("scatter", ValueError, "source_rank", id="too-big", source_rank=SIZE),
    case("scatter", TypeError, "source_rank", id="float", source_rank=0.0),
    case("gather", TypeError, "output", id="output-none-on-the-destination", output=None),
    case("gather", ValueError, "output", id="output-off-the-destination", destination_rank=1),
    case("scatter", TypeError, "input", id="input-none-on-the-source", input=None),
    case("scatter", ValueError, "input", id="input-off-the-source", source_rank=2),
]

RANK_CASES = [
    case("broadcast", ValueError, "source_rank", id="source-rank-too-big", source_rank=SIZE),
    case("broadcast", ValueError, "source_rank", id="source-rank-negative", source_rank=-1),
    case("broadcast", TypeError, "source_rank", id="source-rank-float", source_rank=0.0),
    case("broadcast", TypeError, "source_rank", id="source-rank-bool", source_rank=False),
    case("broadcast", TypeError, "source_rank", id="source-rank-str", source_rank="0"),
    case(
        "broadcast_objects", ValueError, "source_rank", id="source-rank-too-big", source_rank=SIZE
    ),
    case("broadcast_objects", TypeError, "source_rank", id="source-rank-none", source_rank=None),
    case("send", ValueError, "destination_rank", id="to-self", destination_rank=RANK),
    case("send", ValueError, "destination_rank", id="too-big", destination_rank=SIZE),
    case("send", ValueError, "destination_rank", id="negative", destination_rank=-1),
    case("send", TypeError, "destination_rank", id="float", destination_rank=1.0),
    case("recv", ValueError, "source_rank", id="from-self", source_rank=RANK),
    case("recv", ValueError, "source_rank", id="too-big", source_rank=SIZE + 5),
    case("recv", TypeError, "source_rank", id="str", source_rank="1"),
]

# Objects that cannot be encoded are not refused before issue: the op is issued all the
# same so that the other ranks learn of it (tests/world/test_objects.py).
OBJECT_CASES = [
    case("broadcast_objects", TypeError, "objects", id="a-tuple", objects=("config",)),
    case("broadcast_objects", ValueError, "serializer", id="serializer", serializer="json"),
    case("all_gather_objects", ValueError, "serializer", id="serializer", serializer=None),
]

TIMEOUT_CASES = [
    case(collective, error, "timeout", id=f"timeout-{name}", timeout=timeout)
    for collective in COLLECTIVES
    for name, timeout, error in [
        ("negative", -1.0, ValueError),
        ("minus-infinity", -math.inf, ValueError),
        ("nan", math.nan, ValueError),
        ("str", "5", TypeError),
        ("bool", True, TypeError),
    ]
]

REDUCE_OP_CASES = [
    case("all_reduce", TypeError, "op", id="op-str", op="sum"),
    case("all_reduce", TypeError, "op", id="op-c10d", op=dist.ReduceOp.SUM),
    case("reduce_scatter", TypeError, "op", id="op-c10d", op=dist.ReduceOp.MAX),
    case("reduce", TypeError, "op", id="op-str", op="max"),
    case(
        "reduce",
        TypeError,
        "tensor",
        id="mean-of-ints",
        tensor=torch.ones(4, dtype=torch.int32),
        op=ReduceOp.MEAN,
    ),
    case(
        "reduce",
        TypeError,
        "tensor",
        id="min-of-complex",
        tensor=torch.ones(4, dtype=torch.complex64),
        op=ReduceOp.MIN,
    ),
    case(
        "all_reduce",
        TypeError,
        "tensor",
        id="mean-of-ints",
        tensor=torch.ones(4, dtype=torch.int64),
        op=ReduceOp.MEAN,
    ),
    case(
        "reduce_scatter",
        TypeError,
        "input",
        id="mean-of-ints",
        output=torch.empty(4, dtype=torch.int32),
        input=torch.ones(SIZE, 4, dtype=torch.int32),
        op=ReduceOp.MEAN,
    ),
    *[
        case(
            "all_reduce",
            TypeError,
            "tensor",
            id=f"{op.name.lower()}-of-complex",
            tensor=torch.ones(4, dtype=torch.complex64),
            op=op,
        )
        for op in (ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)
    ],
    case(
        "reduce_scatter",
        TypeError,
        "input",
        id="product-of-complex",
        output=torch.empty(4, dtype=torch.complex128),
        input=torch.ones(SIZE, 4, dtype=torch.complex128),
        op=ReduceOp.PRODUCT,
    ),
]

BAD_CALLS = [
    *bad_tensor_cases(),
    *SHAPE_CASES,
    *UNEVEN_CASES,
    *EXCHANGE_CASES,
    *ROOTED_SHAPE_CASES,
    *ROOT_CASES,
    *RANK_CASES,
    *OBJECT_CASES,
    *TIMEOUT_CASES,
    *REDUCE_OP_CASES,
]


# Checking input does not depend on the loop, so the many cases run on one backend.
ONE_BACKEND = pytest.mark.parametrize(
    "anyio_backend", [pytest.param(("asyncio", {"use_uvloop": False}), id="asyncio")]
)


@ONE_BACKEND
@pytest.mark.parametrize(("collective", "bad_call", "error", "parameter"), BAD_CALLS)
async def test_bad_input_is_refused_before_anything_is_issued(
    collective: str,
    bad_call: Callable[[agang.Gang], object],
    error: type[Exception],
    parameter: str,
) -> None:
    world = FakeWorld(SIZE)
    assert [h.seq for h in await run_everywhere(world, collective)] == [0] * SIZE
    num_issued = world[RANK].statistics().num_issued

    with pytest.raises(error, match=re.escape(f"`{parameter}`")):
        bad_call(world[RANK])

    assert world[RANK].statistics().num_issued == num_issued
    # Had the refused call been issued (or numbered), these ops would not meet the others'.
    handles = await run_everywhere(world, collective)
    assert [h.seq for h in handles] == [ops_per_round(collective)] * SIZE


# FakeGang has no peers to send to or receive from: it refuses every send and recv.
@pytest.mark.parametrize(
    ("collective", "bad_call", "error", "parameter"),
    [case for case in BAD_CALLS if case.values[0] not in ("send", "recv", "exchange")],
)
def test_fake_gang_refuses_the_same_input(
    collective: str,
    bad_call: Callable[[agang.Gang], object],
    error: type[Exception],
    parameter: str,
) -> None:
    gang = agang.FakeGang(rank=RANK, size=SIZE)

    with pytest.raises(error, match=re.escape(f"`{parameter}`")):
        bad_call(gang)

    assert gang.statistics().num_issued == 0
    handle = call(gang, collective)
    handle.wait(timeout=10)
    assert handle.seq == 0


async def test_messages_say_what_was_expected_and_what_was_given() -> None:
    gang = FakeWorld(2)[0]

    with pytest.raises(ValueError, match=r"^`timeout` must be .*, but is -1 instead\.$"):
        gang.barrier(timeout=-1)
    with pytest.raises(TypeError, match=r"^`tensor` must .*, but has dtype torch\.int16 instead"):
        gang.all_reduce(torch.ones(2, dtype=torch.int16))
    with pytest.raises(ValueError, match=r"^`tensor` must be on .*\(cpu\), but is on meta"):
        gang.broadcast(torch.ones(2, device="meta"))
    with pytest.raises(ValueError, match=r"^`source_rank` must be .*\(2\), but is 7 instead\.$"):
        gang.broadcast(torch.ones(2), source_rank=7)
    with pytest.raises(
        ValueError,
        match=r"^`tensor` must hold its values in memory, but is a lazily conjugated view "
        r"\(`is_conj\(\)` is True\) instead; call `\.resolve_conj\(\)` first\.$",
    ):
        gang.all_reduce(torch.ones(2, dtype=torch.complex64).conj())
    with pytest.raises(
        ValueError,
        match=r"^`input` must hold its values in memory, but is a lazily negated view "
        r"\(`is_neg\(\)` is True\) instead; call `\.resolve_neg\(\)` first\.$",
    ):
        gang.all_gather(torch.empty(2, 2), torch._neg_view(torch.ones(2)))


async def test_a_lazy_view_once_resolved_is_reduced_by_its_values() -> None:
    world = FakeWorld(2)
    values = [torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64) * (r + 1) for r in range(2)]
    real = [torch.tensor([1.0, -2.0]) * (r + 1) for r in range(2)]

    conjugated = [
        gang.all_reduce(v.conj().resolve_conj()) for gang, v in zip(world, values, strict=True)
    ]
    negated = [
        gang.all_reduce(torch._neg_view(x).resolve_neg())
        for gang, x in zip(world, real, strict=True)
    ]
    # `.conj()` of a real tensor is the tensor itself: no flag, nothing refused.
    plain = [gang.all_reduce(x.conj()) for gang, x in zip(world, real, strict=True)]

    for handle in conjugated:
        assert (await handle).tolist() == (3 * values[0].conj()).tolist()
    for handle in negated:
        assert (await handle).tolist() == [-3.0, 6.0]
    for handle in plain:
        assert (await handle).tolist() == [3.0, -6.0]


async def test_a_busy_tensor_is_refused_and_the_ranks_stay_in_step() -> None:
    world = FakeWorld(2, op_timeout=math.inf)
    tensors = [torch.full((3,), float(rank + 1)) for rank in range(2)]
    first = world[0].all_reduce(tensors[0])  # pending: rank 1 has not issued yet

    with pytest.raises(agang.TensorBusyError, match="`tensor`") as info:
        world[0].broadcast(tensors[0])
    assert isinstance(info.value, ValueError)
    assert "`all_reduce` (seq 0)" in str(info.value)

    second = world[1].all_reduce(tensors[1])
    assert await first is tensors[0]
    assert await second is tensors[1]
    handles = [gang.broadcast(t, source_rank=1) for gang, t in zip(world, tensors, strict=True)]
    for handle in handles:
        await handle
    assert [h.seq for h in handles] == [1, 1]
    assert tensors[0].tolist() == tensors[1].tolist() == [3.0, 3.0, 3.0]


@pytest.mark.parametrize("collective", COLLECTIVES)
async def test_a_closed_gang_refuses_every_collective(collective: str) -> None:
    world = FakeWorld(SIZE)
    await world[RANK].close()

    with pytest.raises(agang.GangClosedError):
        call(world[RANK], collective)


async def test_bad_input_on_a_closed_gang_still_names_the_parameter() -> None:
    gang = FakeWorld(2)[0]
    await gang.close()

    with pytest.raises(ValueError, match="`timeout`"):
        gang.barrier(timeout=math.nan)


# Zero-element tensors.


def zero_element_arguments(collective: str, rank: int, size: int) -> dict[str, Any]:
    match collective:
        case "all_reduce" | "broadcast":
            return {"tensor": torch.empty(0)}
        case "all_gather":
            return {"output": torch.empty(size, 0), "input": torch.empty(0)}
        case "all_gather_to_list":
            return {"outputs": [torch.empty(0) for _ in range(size)], "input": torch.empty(0)}
        case "reduce_scatter":
            return {"output": torch.empty(0), "input": torch.empty(size, 0)}
        case "all_to_all":
            return {"output": torch.empty(0), "input": torch.empty(0)}
        case "send":
            return {"tensor": torch.empty(0), "destination_rank": (rank + 1) % size}
        case "recv":
            return {"tensor": torch.empty(0), "source_rank": (rank - 1) % size}
    raise AssertionError(collective)


ZERO_ELEMENT_COLLECTIVES = [
    "all_reduce",
    "all_gather",
    "all_gather_to_list",
    "reduce_scatter",
    "broadcast",
    "all_to_all",
    "send",
    "recv",
]


@pytest.mark.parametrize("collective", ZERO_ELEMENT_COLLECTIVES)
async def test_zero_element_tensors_give_the_same_outcome_on_every_rank(collective: str) -> None:
    world = FakeWorld(SIZE)

    handles = await run_everywhere(world, collective, zero_element_arguments)

    outcomes = [describe(handle.result()) for handle in handles]
    assert all(outcome == outcomes[0] for outcome in outcomes)
    assert all(handle.num_bytes == 0 for handle in handles)
    # The gang is fine afterwards.
    handles = await run_everywhere(world, "all_reduce")
    assert [h.seq for h in handles] == [ops_per_round(collective)] * SIZE


def describe(output: object) -> object:
    """What a zero-element output looks like, comparable across ranks."""
    if isinstance(output, torch.Tensor):
        return (tuple(output.shape), output.dtype)
    if isinstance(output, list):
        return [describe(item) for item in output]
    return output


async def test_zero_element_tensors_are_never_busy() -> None:
    world = FakeWorld(2, op_timeout=math.inf)
    empty = torch.empty(0)
    first = world[0].all_reduce(empty)
    second = world[0].broadcast(empty)  # the same (empty) memory, in flight twice

    world[1].all_reduce(torch.empty(0))
    world[1].broadcast(torch.empty(0))
    assert await first is empty
    assert await second is empty


# create_gang.


@pytest.mark.parametrize(
    ("ranks", "error"),
    [
        pytest.param([], ValueError, id="empty"),
        pytest.param([0, 1, 0], ValueError, id="repeated"),
        pytest.param([0, SIZE], ValueError, id="too-big"),
        pytest.param([-1, 0], ValueError, id="negative"),
        pytest.param([0, "1"], TypeError, id="str-element"),
        pytest.param([0, 1.0], TypeError, id="float-element"),
        pytest.param([True, 1], TypeError, id="bool-element"),
        pytest.param("01", TypeError, id="a-str"),
        pytest.param(2, TypeError, id="an-int"),
        pytest.param(None, TypeError, id="none"),
    ],
)
@pytest.mark.parametrize("gang_kind", ["fake_world", "fake_gang"])
async def test_create_gang_refuses_bad_ranks(
    ranks: Any, error: type[Exception], gang_kind: str
) -> None:
    world = FakeWorld(SIZE)
    gang: agang.Gang = world[RANK] if gang_kind == "fake_world" else agang.FakeGang(size=SIZE)

    with pytest.raises(error, match="`ranks`"):
        await gang.create_gang(ranks)

    assert gang.statistics().num_issued == 0
    if gang_kind == "fake_world":
        assert [h.seq for h in await run_everywhere(world, "barrier")] == [0] * SIZE


# agang.init and agang.init_sync.

GOOD_ENV = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def env_without(*names: str, **values: str) -> dict[str, str]:
    return {k: v for k, v in GOOD_ENV.items() if k not in names} | values


BAD_ENVS = [
    pytest.param(env_without(RANK="one"), "RANK", id="rank-not-an-int"),
    pytest.param(env_without(RANK="-1"), "RANK", id="rank-negative"),
    pytest.param(env_without(RANK="2"), "RANK", id="rank-equal-to-world-size"),
    pytest.param(env_without(RANK="5"), "RANK", id="rank-above-world-size"),
    pytest.param(env_without("WORLD_SIZE"), "WORLD_SIZE", id="rank-without-world-size"),
    pytest.param(env_without("RANK"), "RANK", id="world-size-without-rank"),
    pytest.param(env_without(WORLD_SIZE="two"), "WORLD_SIZE", id="world-size-not-an-int"),
    pytest.param(env_without(WORLD_SIZE="0"), "WORLD_SIZE", id="world-size-zero"),
    pytest.param(env_without("MASTER_ADDR"), "MASTER_ADDR", id="no-master-addr"),
    pytest.param(env_without(MASTER_ADDR=""), "MASTER_ADDR", id="empty-master-addr"),
    pytest.param(env_without("MASTER_PORT"), "MASTER_PORT", id="no-master-port"),
    pytest.param(env_without(MASTER_PORT="http"), "MASTER_PORT", id="master-port-not-an-int"),
    pytest.param(env_without(MASTER_PORT="70000"), "MASTER_PORT", id="master-port-too-big"),
    pytest.param(env_without(LOCAL_RANK="x"), "LOCAL_RANK", id="local-rank-not-an-int"),
]


@pytest.mark.parametrize(("env", "variable"), BAD_ENVS)
async def test_init_names_the_bad_variable(env: dict[str, str], variable: str) -> None:
    with pytest.raises(agang.GangInitError, match=f"`{variable}`"):
        await agang.init(env=env, timeout=5)


@pytest.mark.parametrize(("env", "variable"), BAD_ENVS)
def test_init_sync_names_the_bad_variable(env: dict[str, str], variable: str) -> None:
    with pytest.raises(agang.GangInitError, match=f"`{variable}`"):
        agang.init_sync(env=env, timeout=5)


BAD_INIT_ARGUMENTS = [
    pytest.param({"backend": "nccl", "device": "cpu"}, ValueError, "device", id="nccl-on-cpu"),
    pytest.param({"backend": "nccl"}, ValueError, "device", id="nccl-without-cuda"),
    pytest.param({"backend": "mpi"}, ValueError, "backend", id="unknown-backend"),
    pytest.param({"backend": "gloo", "device": "meta"}, ValueError, "device", id="gloo-on-meta"),
    pytest.param({"device": "not-a-device"}, ValueError, "device", id="bad-device-string"),
    pytest.param({"timeout": -1}, ValueError, "timeout", id="negative-timeout"),
    pytest.param({"timeout": math.nan}, ValueError, "timeout", id="nan-timeout"),
    pytest.param({"timeout": "60"}, TypeError, "timeout", id="str-timeout"),
    pytest.param({"op_timeout": -0.5}, ValueError, "op_timeout", id="negative-op-timeout"),
    pytest.param({"op_timeout": "soon"}, TypeError, "op_timeout", id="str-op-timeout"),
    pytest.param({"in_process": "yes"}, TypeError, "in_process", id="in-process-not-a-bool"),
]


@pytest.mark.parametrize(("arguments", "error", "parameter"), BAD_INIT_ARGUMENTS)
async def test_init_names_the_bad_argument(
    arguments: dict[str, Any], error: type[Exception], parameter: str
) -> None:
    if arguments == {"backend": "nccl"} and torch.cuda.is_available():
        pytest.skip("with CUDA, nccl picks a CUDA device: a bare nccl is refused only without one")
    with pytest.raises(error, match=f"`{parameter}`"):
        await agang.init(env={}, **arguments)


@pytest.mark.parametrize(("arguments", "error", "parameter"), BAD_INIT_ARGUMENTS)
def test_init_sync_names_the_bad_argument(
    arguments: dict[str, Any], error: type[Exception], parameter: str
) -> None:
    if arguments == {"backend": "nccl"} and torch.cuda.is_available():
        pytest.skip("with CUDA, nccl picks a CUDA device: a bare nccl is refused only without one")
    with pytest.raises(error, match=f"`{parameter}`"):
        agang.init_sync(env={}, **arguments)


SINGLE_PROCESS_ENVS = [
    pytest.param({}, id="no-variables"),
    pytest.param({"RANK": "0", "WORLD_SIZE": "1"}, id="world-size-1"),
    pytest.param({"PATH": "/usr/bin", "HOME": "/root"}, id="unrelated-variables"),
]


async def check_in_process_gang(gang: agang.Gang) -> None:
    assert (gang.rank, gang.size) == (0, 1)
    assert gang.device == torch.device("cpu")
    tensor = torch.arange(3.0)
    assert await gang.all_reduce(tensor) is tensor
    assert tensor.tolist() == [0.0, 1.0, 2.0]
    assert await gang.all_gather_objects("me") == ["me"]
    await gang.close()
    assert gang.closed


@pytest.mark.parametrize("env", SINGLE_PROCESS_ENVS)
async def test_init_without_a_world_gives_an_in_process_gang(env: dict[str, str]) -> None:
    gang = await agang.init(env=env, backend="gloo")

    await check_in_process_gang(gang)


@pytest.mark.parametrize("env", SINGLE_PROCESS_ENVS)
async def test_init_sync_without_a_world_gives_an_in_process_gang(env: dict[str, str]) -> None:
    gang = agang.init_sync(env=env, backend="gloo")

    await check_in_process_gang(gang)
