"""Random programs of collectives give the results plain torch computes, on every gang.

A program is a list of steps (all_reduce, broadcast, all_gather, a coalesce scope, a
bucketed all-reduce), each on the root gang or on lane "a" or "b", with the places where
every outstanding handle is awaited; between those, several steps are in flight at once,
so a rank that mixed up its order would meet the wrong op. Every rank builds its inputs
from (seed, rank, step, member) alone, so the expected outputs are computed in plain
torch (``agang.testing.reduce_tensors``) in the test process.

One generator draws programs, through a small ``Chooser`` interface: Hypothesis drives it
for FakeWorld (many examples, shrinking), and ``random.Random(seed)`` drives it for Gloo,
where a fixed list of programs runs in one ``run_world`` per configuration (a world costs
seconds to start; an example costs milliseconds once it runs).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import agang
from agang import ReduceOp
from agang.testing import FakeWorld, reduce_tensors, run_world

T = TypeVar("T")

DTYPES = ("float32", "float64", "int64")
INTEGER_OPS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)
FLOAT_OPS = (*INTEGER_OPS, ReduceOp.MEAN)
LANES = (None, "a", "b")
KINDS = ("all_reduce", "broadcast", "all_gather", "coalesce", "bucketed")
MAX_STEPS = 8


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


# The generator, driven by Hypothesis or by random.Random.


class Chooser(Protocol):
    def integer(self, low: int, high: int) -> int:
        """An integer in [low, high]."""

    def choice(self, options: Sequence[T]) -> T: ...


class RandomChooser:
    def __init__(self, seed: int) -> None:
        self._random = random.Random(seed)

    def integer(self, low: int, high: int) -> int:
        return self._random.randint(low, high)

    def choice(self, options: Sequence[T]) -> T:
        return self._random.choice(options)


class DrawChooser:
    def __init__(self, draw: st.DrawFn) -> None:
        self._draw = draw

    def integer(self, low: int, high: int) -> int:
        return self._draw(st.integers(low, high))

    def choice(self, options: Sequence[T]) -> T:
        return self._draw(st.sampled_from(options))


def draw_spec(choose: Chooser, dtypes: Sequence[str] = DTYPES) -> Spec:
    # Up to 3 dimensions of 0 to 4: scalars and zero-element tensors included.
    shape = tuple(choose.integer(0, 4) for _ in range(choose.integer(0, 3)))
    return Spec(choose.choice(dtypes), shape)


def draw_all_reduce(choose: Chooser, lane: str | None) -> AllReduce:
    spec = draw_spec(choose)
    return AllReduce(lane, choose.choice(FLOAT_OPS if spec.is_float else INTEGER_OPS), spec)


def draw_step(choose: Chooser, size: int) -> Step:
    lane = choose.choice(LANES)
    kind = choose.choice(KINDS)
    if kind == "all_reduce":
        return draw_all_reduce(choose, lane)
    if kind == "broadcast":
        return Broadcast(lane, choose.integer(0, size - 1), draw_spec(choose))
    if kind == "all_gather":
        return AllGather(lane, draw_spec(choose))
    if kind == "coalesce":
        members: list[AllReduce | Broadcast] = []
        for _ in range(choose.integer(1, 5)):
            if choose.integer(0, 5) == 0:
                members.append(Broadcast(lane, choose.integer(0, size - 1), draw_spec(choose)))
            else:
                members.append(draw_all_reduce(choose, lane))
        return Coalesced(lane, tuple(members))
    tensors = tuple(draw_spec(choose) for _ in range(choose.integer(1, 6)))
    ops = FLOAT_OPS if all(t.is_float for t in tensors) else INTEGER_OPS
    bucket_bytes = choose.choice((1, 8, 24, 64, 1 << 20))
    return Bucketed(lane, choose.choice(ops), tensors, bucket_bytes)


def draw_program(choose: Chooser, size: int) -> Program:
    steps = tuple(draw_step(choose, size) for _ in range(choose.integer(1, MAX_STEPS)))
    awaits = frozenset(i for i in range(len(steps)) if choose.integer(0, 2) == 0)
    return Program(size, choose.integer(0, 2**16), steps, awaits)


@st.composite
def programs(draw: st.DrawFn) -> Program:
    return draw_program(DrawChooser(draw), draw(st.integers(2, 4)))


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


def expected_outputs(program: Program, index: int, rank: int) -> list[torch.Tensor]:
    """What rank ``rank`` must hold after step ``index``, in plain torch."""
    step = program.steps[index]

    def inputs(member: int, spec: Spec) -> list[torch.Tensor]:
        return [make_input(program, r, index, member, spec) for r in range(program.size)]

    def one(member: int, part: AllReduce | Broadcast | AllGather) -> torch.Tensor:
        values = inputs(member, part.tensor)
        if isinstance(part, AllReduce):
            return reduce_tensors(values, part.op)
        if isinstance(part, Broadcast):
            return values[part.source_rank]
        return torch.stack(values)

    if isinstance(step, Coalesced):
        return [one(m, member) for m, member in enumerate(step.members)]
    if isinstance(step, Bucketed):
        return [reduce_tensors(inputs(m, spec), step.op) for m, spec in enumerate(step.tensors)]
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
async def test_random_programs_on_fake_world(
    program: Program, check_order: bool, latency: float
) -> None:
    world = FakeWorld(program.size, latency=latency, check_order=check_order, op_timeout=30.0)
    outcomes = await world.run(functools.partial(run_program, program=program))

    check_outcomes(program, outcomes)
    for gang in world.gangs:
        await gang.close()


# Gloo: a fixed, seeded list of programs, all run in one world per configuration.


def gloo_programs(size: int) -> list[Program]:
    return [draw_program(RandomChooser(seed * 10 + size), size) for seed in range(16)]


def test_the_seeded_programs_draw_every_kind_of_step() -> None:
    # The seeded lists are no weaker than the Hypothesis strategy: they meet every kind
    # of step on every gang, every reduce op, scalars, zero-element tensors, and steps
    # left in flight while later ones are issued.
    for size in (2, 3):
        program_list = gloo_programs(size)
        steps = [step for program in program_list for step in program.steps]
        assert {(type(step).__name__, step.lane) for step in steps} == {
            (kind.__name__, lane)
            for kind in (AllReduce, Broadcast, AllGather, Coalesced, Bucketed)
            for lane in LANES
        }
        assert {step.op for step in steps if isinstance(step, AllReduce)} == set(FLOAT_OPS)
        specs = [spec for step in steps for spec in tensor_specs(step)]
        assert any(0 in spec.shape for spec in specs)
        assert any(spec.shape == () for spec in specs)
        assert any(len(p.awaits) < len(p.steps) - 1 for p in program_list)


async def _run_programs(gang: agang.Gang, program_list: Sequence[Program]) -> list[Outcome]:
    return [await run_program(gang, program) for program in program_list]


@pytest.mark.gloo
@pytest.mark.parametrize(
    ("size", "async_backend", "check_order"),
    [(2, "asyncio", False), (3, "trio", True)],
    ids=["2-ranks-asyncio-unchecked", "3-ranks-trio-order-checked"],
)
def test_random_programs_on_gloo(size: int, async_backend: str, check_order: bool) -> None:
    program_list = gloo_programs(size)
    runner: Callable[[agang.Gang], Any] = functools.partial(
        _run_programs, program_list=program_list
    )
    outcomes = run_world(
        runner,
        size,
        async_backend=async_backend,
        op_timeout=30.0,
        init_options={"check_order": check_order},
    )

    for number, program in enumerate(program_list):
        check_outcomes(program, [by_rank[number] for by_rank in outcomes])
