"""What each simulated NCCL kernel computes once every rank's part of it runs.

Every kernel reads all its inputs before writing any output, in rank order, and writes
in place: the data moves when the device runs the kernel, not when the op is issued.

A reducing kernel reduces as ``FakeWorld`` does, with
[`agang.testing.reduce_tensors`][agang.testing.reduce_tensors], so the two simulations
cannot drift apart: in rank order, in the tensors' dtype, rounding
after each rank's contribution (as NCCL's ring rounds at each hop, in its own order).
c10d's op is mapped back to agang's through agang's own mapping (``to_c10d``), so the
simulation reduces with exactly the ops agang issues on NCCL, AVG included; any other op
is an error when the kernel runs. ``MEAN`` on integers and booleans never gets here:
agang refuses it before issuing (``agang._validate``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from agang._backends.c10d.calls import to_c10d
from agang._backends.sim_nccl.device import Part
from agang._backends.sim_nccl.reduce import reduce_tensors
from agang._reduce_op import ReduceOp

Kernel = Callable[[dict[int, Part]], None]


#: agang's op for each c10d op that agang issues on NCCL, made once: a kernel looks its
#: op up, in one step, rather than comparing with each (which cost a raw caller without
#: options nothing, and a caller with them a few microseconds per op).
_FROM_C10D = {to_c10d(op, backend="nccl")[0]: op for op in ReduceOp}


def _op(options: Any) -> ReduceOp:
    """agang's op for ``options.reduceOp`` (SUM where an op has no options)."""
    if options is None:
        return ReduceOp.SUM
    c10d_op = options.reduceOp
    c10d_op = getattr(c10d_op, "op", c10d_op)  # the options hold a wrapper of the enum
    op = _FROM_C10D.get(c10d_op)
    if op is None:
        raise NotImplementedError(f"Simulated NCCL does not reduce with {c10d_op}.")
    return op


def _ranked(parts: dict[int, Part]) -> list[Part]:
    return [parts[r] for r in sorted(parts)]


def kernel_for(kind: str, options: Any) -> Kernel:
    """The kernel of a ``kind`` op issued with ``options`` (the first rank's)."""

    def allreduce(parts: dict[int, Part]) -> None:
        ranked = _ranked(parts)
        op = _op(options)
        for index in range(len(ranked[0].inputs)):
            result = reduce_tensors([p.inputs[index] for p in ranked], op)
            for p in ranked:
                p.outputs[index].copy_(result)

    def broadcast(parts: dict[int, Part]) -> None:
        source = parts[options.rootRank].inputs[options.rootTensor].clone()
        for p in parts.values():
            p.outputs[0].copy_(source)

    def allgather(parts: dict[int, Part]) -> None:
        inputs = [p.inputs[0].clone() for p in _ranked(parts)]
        for p in parts.values():
            for out, value in zip(p.outputs[0], inputs, strict=True):
                out.copy_(value)

    def all_gather_single(parts: dict[int, Part]) -> None:
        flat = torch.cat([p.inputs.reshape(-1).clone() for p in _ranked(parts)])
        for p in parts.values():
            p.outputs.view(-1).copy_(flat)

    def reduce_scatter_single(parts: dict[int, Part]) -> None:
        ranked = _ranked(parts)
        total = reduce_tensors([p.inputs.reshape(-1) for p in ranked], _op(options))
        for rank, chunk in enumerate(total.chunk(len(ranked))):
            ranked[rank].outputs.view(-1).copy_(chunk)

    def all_to_all_single(parts: dict[int, Part]) -> None:
        # Blocks of rows; no split sizes (an empty list) means equal blocks.
        ranked = _ranked(parts)
        size = len(ranked)

        def blocks(tensor: torch.Tensor, splits: list[int]) -> list[torch.Tensor]:
            splits = splits or [tensor.shape[0] // size] * size
            return list(tensor.clone().split_with_sizes(splits))

        sent = [blocks(*p.inputs) for p in ranked]
        received = [[sent[j][rank] for j in range(size)] for rank in range(size)]
        for rank, p in enumerate(ranked):
            expected = [b.shape for b in blocks(*p.outputs)]
            if [b.shape for b in received[rank]] != expected:  # NCCL: undefined; an error here
                raise RuntimeError(
                    f"Simulated NCCL: the split sizes of all_to_all_single disagree at "
                    f"rank {rank}: it expects blocks {expected}, its peers send "
                    f"{[b.shape for b in received[rank]]}."
                )
        for rank, p in enumerate(ranked):
            p.outputs[0].copy_(torch.cat(received[rank]))

    def coalesced(parts: dict[int, Part]) -> None:
        # The end of a coalescing group (``options``: its transfers' parts).
        for part in options:
            if part.error is not None:
                raise part.error

    # The rooted ops write on their root only (reduce, gather) or read from it (scatter).

    def reduce(parts: dict[int, Part]) -> None:
        result = reduce_tensors([p.inputs[0] for p in _ranked(parts)], _op(options))
        parts[options.rootRank].outputs[0].copy_(result)

    def gather(parts: dict[int, Part]) -> None:
        outputs = parts[options.rootRank].outputs[0]
        for out, p in zip(outputs, _ranked(parts), strict=True):
            out.copy_(p.inputs[0])

    def scatter(parts: dict[int, Part]) -> None:
        inputs = parts[options.rootRank].inputs[0]
        for p, value in zip(_ranked(parts), inputs, strict=True):
            p.outputs[0].copy_(value)

    def send(parts: dict[int, Part]) -> None:
        sender = next(p for p in parts.values() if p.inputs is not None)
        receiver = next(p for p in parts.values() if p.outputs is not None)
        receiver.outputs[0].copy_(sender.inputs[0])

    def barrier(parts: dict[int, Part]) -> None:
        pass

    kernels: dict[str, Kernel] = {
        "allreduce": allreduce,
        "broadcast": broadcast,
        "allgather": allgather,
        "all_gather_single": all_gather_single,
        "reduce_scatter_single": reduce_scatter_single,
        "all_to_all_single": all_to_all_single,
        "reduce": reduce,
        "gather": gather,
        "scatter": scatter,
        "send": send,
        "barrier": barrier,
        "coalesced": coalesced,
    }
    return kernels[kind]
