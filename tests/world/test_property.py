"""Random programs of collectives give the results plain torch computes, on every gang.

A program is a list of steps (all_reduce, broadcast, all_gather, a coalesce scope, a
bucketed all-reduce), each on the root gang or on lane "a" or "b", with the places where
every outstanding handle is awaited; between those, several steps are in flight at once,
so a rank that mixed up its order would meet the wrong op. Every rank builds its inputs
from (seed, rank, step, member) alone, so the test process computes the expected outputs
itself: a sum, product, min, max or mean over the ranks' stacked inputs in plain torch,
written here and not taken from agang (FakeWorld's own reduction is agang's code).

Hypothesis draws the programs, and shrinks a failing one, on both kinds of world: on
FakeWorld, many examples on every async backend; on Gloo, one world per configuration
stays up for the whole test and runs each program as it is drawn (``ServedWorld``, in
``property_world.py``): a world costs seconds to start, an example tens of milliseconds.
Each test first runs ``tour``, one program with every kind of step on every gang, every
reduce op, scalars, zero-element tensors and steps in flight, so every run meets them all
whatever Hypothesis draws next; and the strategy is shown to reach each of them too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, example, find, given, settings
from hypothesis import strategies as st
from property_world import ServedWorld

import agang
from agang import ReduceOp
from agang.testing import FakeWorld

DTYPES = ("float32", "float64", "int64")
INTEGER_OPS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)
FLOAT_OPS = (*INTEGER_OPS, ReduceOp.MEAN)
LANES = (None, "a", "b")
BUCKET_BYTES = (1, 8, 24, 64, 1 << 20)
MAX_STEPS = 8
FAKE_WORLD_SIZES = st.integers(2, 4)
# Examples per Gloo configuration: on a 2-core machine, about 8 s on 2 ranks and 16 s on
# 3 ranks (trio, order-checked), start-up included; tens of ms an example.
GLOO_EXAMPLES = 100


# Programs: plain, picklable data.


@dataclass(frozen=True)
class Spec:
    """The dtype and shape of one input tensor (the same on every rank)."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def is_float(self) -> bool:
        return self.dtype != "int64"


@dataclass(frozen=True)
class AllReduce:
    lane: str | None
    op: ReduceOp
    tensor: Spec


@dataclass(frozen=True)
class Broadcast:
    lane: str | None
    source_rank: int
    tensor: Spec


@dataclass(frozen=True)
class AllGather:
    lane: str | None
    tensor: Spec


@dataclass(frozen=True)
class Coalesced:
    """A ``coalesce()`` scope: its all-reduces are held and issued as flat ops at its end;
    a broadcast inside it first issues what the scope holds (program order is kept)."""

    lane: str | None
    members: tuple[AllReduce | Broadcast, ...]


@dataclass(frozen=True)
class Bucketed:
    lane: str | None
    op: ReduceOp
    tensors: tuple[Spec, ...]
    bucket_bytes: int


Step = AllReduce | Broadcast | AllGather | Coalesced | Bucketed


@dataclass(frozen=True)
class Program:
    size: int
    seed: int
    steps: tuple[Step, ...]
    awaits: frozenset[int]  # after these steps, every outstanding handle is awaited


# The strategies that draw programs. Each is built once (per lane and size): Hypothesis
# validates every new strategy object, which costs more than drawing from it.

# Up to 3 dimensions of 0 to 4: scalars and zero-element tensors included.
SPECS = st.builds(Spec, st.sampled_from(DTYPES), st.lists(st.integers(0, 4), max_size=3).map(tuple))
REDUCE_OPS = {True: st.sampled_from(FLOAT_OPS), False: st.sampled_from(INTEGER_OPS)}


@functools.cache
@st.composite
def all_reduces(draw: st.DrawFn, lane: str | None) -> AllReduce:
    spec = draw(SPECS)
    return AllReduce(lane, draw(REDUCE_OPS[spec.is_float]), spec)


@functools.cache
def broadcasts(lane: str | None, size: int) -> st.SearchStrategy[Broadcast]:
    return st.builds(Broadcast, st.just(lane), st.integers(0, size - 1), SPECS)


@st.composite
def coalesce_members(draw: st.DrawFn, lane: str | None, size: int) -> AllReduce | Broadcast:
    # Mostly all-reduces, which the scope holds; now and then a broadcast, which first
    # issues what the scope holds. Shrinking goes towards all-reduces.
    if draw(st.integers(0, 5)) == 5:
        return draw(broadcasts(lane, size))
    return draw(all_reduces(lane))


def coalesce_scopes(lane: str | None, size: int) -> st.SearchStrategy[Coalesced]:
    members = st.lists(coalesce_members(lane, size), min_size=1, max_size=5).map(tuple)
    return st.builds(Coalesced, st.just(lane), members)


@st.composite
def bucketed_all_reduces(draw: st.DrawFn, lane: str | None) -> Bucketed:
    tensors = tuple(draw(st.lists(SPECS, min_size=1, max_size=6)))
    op = draw(REDUCE_OPS[all(spec.is_float for spec in tensors)])
    return Bucketed(lane, op, tensors, draw(st.sampled_from(BUCKET_BYTES)))


@functools.cache
def steps(size: int) -> st.SearchStrategy[Step]:
    """Every kind of step, on every gang, alike likely."""
    kinds: list[st.SearchStrategy[Step]] = []
    for lane in LANES:
        kinds += [
            all_reduces(lane),
            broadcasts(lane, size),
            st.builds(AllGather, st.just(lane), SPECS),
            coalesce_scopes(lane, size),
            bucketed_all_reduces(lane),
        ]
    return st.one_of(kinds)


@st.composite
def programs(draw: st.DrawFn, sizes: st.SearchStrategy[int] = FAKE_WORLD_SIZES) -> Program:
    size = draw(sizes)
    drawn = tuple(draw(st.lists(steps(size), min_size=1, max_size=MAX_STEPS)))
    # Where a step's handles are not awaited, the next steps are issued with it in flight.
    awaited = draw(st.lists(st.booleans(), min_size=len(drawn), max_size=len(drawn)))
    awaits = frozenset(index for index, yes in enumerate(awaited) if yes)
    return Program(size, draw(st.integers(0, 2**16)), drawn, awaits)


# What programs must exercise, and one program that exercises it all.

EVERY_FEATURE: frozenset[object] = frozenset(
    {
        (kind.__name__, lane)
        for kind in (AllReduce, Broadcast, AllGather, Coalesced, Bucketed)
        for lane in LANES
    }
    | set(FLOAT_OPS)
    | {"scalar", "zero elements", "in flight"}
)


def features(program: Program) -> set[object]:
    """What ``program`` exercises: each kind of step on each gang, each reduce op of a
    lone all-reduce, scalars, zero-element tensors, and steps left in flight while the
    next ones are issued."""
    found: set[object] = {(type(step).__name__, step.lane) for step in program.steps}
    found |= {step.op for step in program.steps if isinstance(step, AllReduce)}
    specs = [spec for step in program.steps for spec in tensor_specs(step)]
    if any(spec.shape == () for spec in specs):
        found.add("scalar")
    if any(0 in spec.shape for spec in specs):
        found.add("zero elements")
    if any(index not in program.awaits for index in range(len(program.steps) - 1)):
        found.add("in flight")
    return found


def missing_features(program_list: Sequence[Program]) -> set[object]:
    return set(EVERY_FEATURE).difference(*map(features, program_list))


def tour(size: int) -> Program:
    """Every feature in one program. Each property test runs it first (an explicit
    example), so every run meets them all, whatever Hypothesis draws after it."""
    tour_steps: list[Step] = []
    for lane in LANES:
        tour_steps += [
            *(AllReduce(lane, op, Spec("float32", (2, 3))) for op in FLOAT_OPS),
            AllReduce(lane, ReduceOp.PRODUCT, Spec("int64", ())),
            Broadcast(lane, size - 1, Spec("float64", (0, 2))),
            AllGather(lane, Spec("int64", (3,))),
            Coalesced(
                lane,
                (
                    AllReduce(lane, ReduceOp.SUM, Spec("float32", (4,))),
                    Broadcast(lane, 0, Spec("int64", ())),
                    AllReduce(lane, ReduceOp.MEAN, Spec("float64", (2,))),
                    AllReduce(lane, ReduceOp.MAX, Spec("int64", (1, 2))),
                ),
            ),
            Bucketed(
                lane,
                ReduceOp.MIN,
                (Spec("float32", (3,)), Spec("float32", ()), Spec("int64", (2, 2))),
                bucket_bytes=8,
            ),
        ]
    # Awaited halfway and at the end only: the other steps are issued with earlier
    # ones in flight.
    return Program(size, seed=1, steps=tuple(tour_steps), awaits=frozenset({len(tour_steps) // 2}))


# Inputs, and what the outputs must be.


def make_input(program: Program, rank: int, step: int, member: int, spec: Spec) -> torch.Tensor:
    """Rank ``rank``'s input for one tensor of one step: small values, so that sums and
    products of up to 4 ranks are exact and never overflow."""
    generator = torch.Generator().manual_seed(
        ((program.seed * 7919 + rank) * 104729 + step) * 131 + member
    )
    values = torch.randint(-2, 3, spec.shape, generator=generator)
    if spec.is_float:
        return (values / 2).to(getattr(torch, spec.dtype))  # halves: exact in binary
    return values


def tensor_specs(step: Step) -> list[Spec]:
    if isinstance(step, Coalesced):
        return [member.tensor for member in step.members]
    if isinstance(step, Bucketed):
        return list(step.tensors)
    return [step.tensor]


# The reference: each reduce op as plain torch computes it over the ranks' inputs, stacked
# on a new first dimension, written here rather than taken from agang (FakeWorld reduces
# with agang.testing.reduce_tensors, so that would check FakeWorld against itself). agang
# reduces in place, so a result keeps its inputs' dtype, which assert_close checks too;
# MEAN is defined on floating dtypes only (agang raises TypeError for an integer tensor:
# it divides after a SUM), so programs draw it for float tensors alone.
PLAIN_REDUCTIONS: dict[ReduceOp, Callable[[torch.Tensor], torch.Tensor]] = {
    ReduceOp.SUM: lambda stacked: stacked.sum(dim=0),
    ReduceOp.PRODUCT: lambda stacked: stacked.prod(dim=0),
    ReduceOp.MIN: lambda stacked: stacked.amin(dim=0),
    ReduceOp.MAX: lambda stacked: stacked.amax(dim=0),
    ReduceOp.MEAN: lambda stacked: stacked.mean(dim=0),
}


def plain_reduction(values: Sequence[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    return PLAIN_REDUCTIONS[op](torch.stack(list(values)))


def expected_outputs(program: Program, index: int, rank: int) -> list[torch.Tensor]:
    """What rank ``rank`` must hold after step ``index``, in plain torch."""
    step = program.steps[index]

    def inputs(member: int, spec: Spec) -> list[torch.Tensor]:
        return [make_input(program, r, index, member, spec) for r in range(program.size)]

    def one(member: int, part: AllReduce | Broadcast | AllGather) -> torch.Tensor:
        values = inputs(member, part.tensor)
        if isinstance(part, AllReduce):
            return plain_reduction(values, part.op)
        if isinstance(part, Broadcast):
            return values[part.source_rank]
        return torch.stack(values)

    if isinstance(step, Coalesced):
        return [one(m, member) for m, member in enumerate(step.members)]
    if isinstance(step, Bucketed):
        return [plain_reduction(inputs(m, spec), step.op) for m, spec in enumerate(step.tensors)]
    return [one(0, step)]


# Running a program on one rank.


@dataclass
class Outcome:
    """What one rank saw: each step's outputs, and the seq of each handle it awaited."""

    outputs: list[list[torch.Tensor]]
    seqs: list[tuple[str | None, int]]


def issue(
    gang: agang.Gang, step: Step, inputs: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[agang.Handle[Any]]]:
    """Issues one step; returns the tensors that will hold its outputs, and its handles."""
    if isinstance(step, AllReduce):
        return inputs, [gang.all_reduce(inputs[0], step.op)]
    if isinstance(step, Broadcast):
        return inputs, [gang.broadcast(inputs[0], step.source_rank)]
    if isinstance(step, AllGather):
        output = torch.empty((gang.size, *inputs[0].shape), dtype=inputs[0].dtype)
        return [output], [gang.all_gather(output, inputs[0])]
    if isinstance(step, Coalesced):
        handles: list[agang.Handle[Any]] = []
        with gang.coalesce():
            for member, tensor in zip(step.members, inputs, strict=True):
                if isinstance(member, AllReduce):
                    handles.append(gang.all_reduce(tensor, member.op))
                else:
                    handles.append(gang.broadcast(tensor, member.source_rank))
        return inputs, handles
    bucket_handles = gang.all_reduce_bucketed(
        inputs, step.op, bucket_bytes=step.bucket_bytes, per_bucket=True
    )
    return inputs, list(bucket_handles)


async def run_program(gang: agang.Gang, program: Program) -> Outcome:
    lanes: dict[str | None, agang.Gang] = {None: gang}
    outcome = Outcome([], [])
    pending: list[tuple[str | None, agang.Handle[Any]]] = []

    async def await_pending() -> None:
        for lane, handle in pending:
            await handle
            outcome.seqs.append((lane, handle.seq))
        pending.clear()

    for index, step in enumerate(program.steps):
        if step.lane not in lanes:
            assert step.lane is not None
            lanes[step.lane] = await gang.lane(step.lane)  # a call on the root gang
        inputs = [
            make_input(program, gang.rank, index, member, spec)
            for member, spec in enumerate(tensor_specs(step))
        ]
        outputs, handles = issue(lanes[step.lane], step, inputs)
        outcome.outputs.append(outputs)
        pending += [(step.lane, handle) for handle in handles]
        if index in program.awaits:
            await await_pending()
    await await_pending()
    for lane in lanes.values():
        assert lane.statistics().num_in_flight == 0
    return outcome


def check_outcomes(program: Program, outcomes: Sequence[Outcome]) -> None:
    note = f"\nprogram: {program!r}"
    assert len(outcomes) == program.size
    for rank, outcome in enumerate(outcomes):
        # Every rank numbered the same ops alike (on each gang, in call order).
        assert outcome.seqs == outcomes[0].seqs, f"rank {rank}: seqs differ{note}"
        for index, outputs in enumerate(outcome.outputs):
            expected = expected_outputs(program, index, rank)
            for member, (actual, wanted) in enumerate(zip(outputs, expected, strict=True)):
                where = f"rank {rank}, step {index}, tensor {member}"
                torch.testing.assert_close(actual, wanted, msg=_describe_failure(where, note))


def _describe_failure(where: str, note: str) -> Callable[[str], str]:
    return lambda message: f"{where}: {message}{note}"


# FakeWorld: many examples, on every async backend.


@pytest.mark.anyio
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    program=programs(),
    check_order=st.booleans(),
    latency=st.sampled_from([0.0, 0.001]),
)
@example(program=tour(3), check_order=True, latency=0.001)
async def test_random_programs_on_fake_world(
    program: Program, check_order: bool, latency: float
) -> None:
    world = FakeWorld(program.size, latency=latency, check_order=check_order, op_timeout=30.0)
    outcomes = await world.run(functools.partial(run_program, program=program))

    check_outcomes(program, outcomes)
    for gang in world.gangs:
        await gang.close()


# Gloo: one world per configuration stays up for the test; each example runs on it.


@pytest.fixture(
    scope="module",
    params=[
        pytest.param((2, "asyncio", False), id="2-ranks-asyncio-unchecked"),
        pytest.param((3, "trio", True), id="3-ranks-trio-order-checked"),
    ],
)
def gloo_world(request: pytest.FixtureRequest) -> Iterator[ServedWorld]:
    size, async_backend, check_order = request.param
    with ServedWorld(
        run_program,
        size,
        async_backend=async_backend,
        op_timeout=30.0,
        init_options={"check_order": check_order},
    ) as world:
        yield world


@pytest.mark.gloo
@pytest.mark.timeout(300)  # room for Hypothesis to shrink a failing program on the world
def test_random_programs_on_gloo(gloo_world: ServedWorld) -> None:
    @settings(max_examples=GLOO_EXAMPLES, deadline=None, database=None)
    @given(program=programs(st.just(gloo_world.size)))
    @example(program=tour(gloo_world.size))
    def gives_plain_results(program: Program) -> None:
        check_outcomes(program, gloo_world.request(program))

    gives_plain_results()
    assert missing_features(gloo_world.requests) == set()


# The programs' reach.


def test_the_tour_has_every_feature() -> None:
    for size in (2, 3, 4):
        assert missing_features([tour(size)]) == set()


@pytest.mark.parametrize("size", [2, 3])
def test_the_strategy_reaches_every_feature(size: int) -> None:
    # Hypothesis explores and shrinks only within what the strategy can draw. Drawing
    # stops once every feature has been met (after about a hundred programs, typically).
    met: set[object] = set()

    def meets_the_last_feature(program: Program) -> bool:
        met.update(features(program))
        return met >= EVERY_FEATURE

    find(
        programs(st.just(size)),
        meets_the_last_feature,
        settings=settings(max_examples=5000, phases=[Phase.generate], database=None),
    )
