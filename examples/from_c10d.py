"""torch.distributed (c10d) calls and their agang forms, run side by side and compared.

Every rank runs each c10d call and then its agang form on clones of the same inputs, on
the same process group (the gang that ``agang.init`` makes is c10d's default group
underneath), and asserts that both give the same tensors and objects.
docs/guides/from-torch-distributed.md walks through it.

    python examples/from_c10d.py

starts 3 local ranks on Gloo with ``agang.testing.run_world``, which sets up each rank's
environment and store as torchrun does, and prints the calls that agreed.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import agang
from agang import ReduceOp
from agang.testing import run_world

# torch 2.13 names them all_gather_single and reduce_scatter_single, and warns that the
# older names, all_gather_into_tensor and reduce_scatter_tensor, are deprecated; an older
# torch may have only those.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def same(name: str, c10d: object, mine: object, agreed: list[str]) -> None:
    """Asserts that the c10d result and agang's are equal, and records ``name``."""
    if isinstance(c10d, torch.Tensor) and isinstance(mine, torch.Tensor):
        assert torch.equal(c10d, mine), (name, c10d, mine)
    elif isinstance(c10d, list) and c10d and isinstance(c10d[0], torch.Tensor):
        assert isinstance(mine, list), (name, mine)
        assert all(torch.equal(a, b) for a, b in zip(c10d, mine, strict=True)), (name, c10d, mine)
    else:
        assert c10d == mine, (name, c10d, mine)
    agreed.append(name)


async def side_by_side(gang: agang.Gang) -> list[str]:
    """One rank: each c10d call (the first lines of a pair), then its agang form."""
    agreed: list[str] = []
    rank, size = gang.rank, gang.size
    x = torch.arange(4.0) + 10 * rank  # this rank's input: it differs by rank

    # dist.get_rank(), dist.get_world_size()
    same(
        "get_rank/get_world_size",
        (dist.get_rank(), dist.get_world_size()),
        (gang.rank, gang.size),
        agreed,
    )

    # dist.all_reduce: in place on both sides; agang's await returns the tensor.
    a = x.clone()
    dist.all_reduce(a, op=dist.ReduceOp.SUM)
    b = await gang.all_reduce(x.clone(), op=ReduceOp.SUM)
    same("all_reduce", a, b, agreed)
    total = a

    a = x.clone()
    dist.all_reduce(a, op=dist.ReduceOp.MAX)
    b = await gang.all_reduce(x.clone(), op=ReduceOp.MAX)
    same("all_reduce MAX", a, b, agreed)

    # c10d's ReduceOp.AVG is NCCL's only: on Gloo it is a sum and a division. agang's
    # MEAN runs on both.
    a = x.clone()
    dist.all_reduce(a)
    a /= size
    b = await gang.all_reduce(x.clone(), op=ReduceOp.MEAN)
    same("all_reduce MEAN", a, b, agreed)

    # async_op=True and work.wait() (which blocks the thread): a handle and await.
    a = x.clone()
    work = dist.all_reduce(a, async_op=True)
    work.wait()
    handle = gang.all_reduce(b := x.clone())  # issued here; work placed now overlaps it
    await handle
    same("all_reduce(async_op=True)", a, b, agreed)

    # dist.all_gather_single (all_gather_into_tensor): agang takes the concatenated
    # layout, as c10d does, or the stacked one.
    a = torch.empty(size * 4)
    all_gather_single(a, x)
    b = await gang.all_gather(torch.empty(size * 4), x)
    same("all_gather_single", a, b, agreed)
    stacked = await gang.all_gather(torch.empty(size, 4), x)
    same("all_gather_single (stacked)", a.view(size, 4), stacked, agreed)

    # dist.all_gather into a list
    a_list = [torch.empty(4) for _ in range(size)]
    dist.all_gather(a_list, x)
    b_list = await gang.all_gather_to_list([torch.empty(4) for _ in range(size)], x)
    same("all_gather", a_list, b_list, agreed)

    # dist.reduce_scatter_single (reduce_scatter_tensor)
    blocks = torch.arange(size * 2.0) + rank
    a = torch.empty(2)
    reduce_scatter_single(a, blocks)
    b = await gang.reduce_scatter(torch.empty(2), blocks)
    same("reduce_scatter_single", a, b, agreed)

    # dist.broadcast(src=...): source_rank=...
    a = x.clone()
    dist.broadcast(a, src=1)
    b = await gang.broadcast(x.clone(), source_rank=1)
    same("broadcast", a, b, agreed)

    # dist.all_to_all_single, with equal blocks and with split sizes
    rows = torch.arange(size * 2.0) + 100 * rank
    a = torch.empty(size * 2)
    dist.all_to_all_single(a, rows)
    b = await gang.all_to_all(torch.empty(size * 2), rows)
    same("all_to_all_single", a, b, agreed)
    sends = [j + 1 for j in range(size)]  # rank j gets j + 1 rows from every rank
    receives = [rank + 1] * size
    rows = torch.arange(float(sum(sends))) + 100 * rank
    a = torch.empty(sum(receives))
    dist.all_to_all_single(a, rows, output_split_sizes=receives, input_split_sizes=sends)
    b = await gang.all_to_all(
        torch.empty(sum(receives)), rows, output_split_sizes=receives, input_split_sizes=sends
    )
    same("all_to_all_single (uneven)", a, b, agreed)

    # dist.reduce(dst=...): the result is defined on the destination only.
    a = x.clone()
    dist.reduce(a, dst=0)
    b = await gang.reduce(x.clone(), destination_rank=0)
    if rank == 0:
        same("reduce", a, b, agreed)

    # dist.gather into a list on the destination: agang gathers into one tensor.
    a_list = [torch.empty(4) for _ in range(size)] if rank == 0 else []
    dist.gather(x, a_list if rank == 0 else None, dst=0)
    gathered = await gang.gather(torch.empty(size, 4) if rank == 0 else None, x, 0)
    if rank == 0:
        same("gather", torch.stack(a_list), gathered, agreed)

    # dist.scatter from a list on the source: agang scatters the blocks of one tensor.
    pieces = [torch.full((2,), float(r)) for r in range(size)]
    a = torch.empty(2)
    dist.scatter(a, pieces if rank == 0 else None, src=0)
    b = await gang.scatter(torch.empty(2), torch.stack(pieces) if rank == 0 else None, 0)
    same("scatter", a, b, agreed)

    # dist.isend / dist.recv around a ring: send and recv handles.
    after, before = (rank + 1) % size, (rank - 1) % size
    request = dist.isend(x, after)
    dist.recv(a := torch.empty(4), before)
    request.wait()
    sent = gang.send(x, destination_rank=after)
    b = await gang.recv(torch.empty(4), source_rank=before)
    await sent
    same("send / recv", a, b, agreed)

    # dist.batch_isend_irecv: exchange, whose await returns the receive tensors.
    ops = [dist.P2POp(dist.isend, x, after), dist.P2POp(dist.irecv, a := torch.empty(4), before)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    [b] = await gang.exchange([(x, after)], [(torch.empty(4), before)])
    same("batch_isend_irecv", a, b, agreed)

    # dist.barrier
    dist.barrier()
    await gang.barrier()

    # Object collectives. c10d's unpickle whatever a peer sent; agang's default
    # serializer takes plain data only and runs no code on read (serializer="pickle"
    # is c10d's behaviour, between ranks that trust each other).
    config = [{"lr": 0.1, "from": rank}]
    a_objects = list(config)
    dist.broadcast_object_list(a_objects, src=0)
    b_objects = await gang.broadcast_objects(list(config), source_rank=0)
    same("broadcast_object_list", a_objects, b_objects, agreed)

    a_objects = [None] * size
    dist.all_gather_object(a_objects, {"rank": rank})
    b_objects = await gang.all_gather_objects({"rank": rank})
    same("all_gather_object", a_objects, b_objects, agreed)

    # dist.new_group: every rank calls it, as every rank calls create_gang, which
    # returns None on the ranks outside. A rank's place in it is its own rank there.
    group = dist.new_group([1, 2])
    pair = await gang.create_gang([1, 2])
    if pair is not None:
        same("get_rank(group)", dist.get_rank(group), pair.rank, agreed)
        a = x.clone()
        dist.all_reduce(a, group=group)
        b = await pair.all_reduce(x.clone())
        same("all_reduce(group=...)", a, b, agreed)

    # A deadline per op, in seconds (c10d's timeout is per group, a timedelta given to
    # init_process_group or new_group): past it, GangTimeoutError names the late ranks.
    b = await gang.all_reduce(x.clone(), timeout=30.0)
    same("all_reduce(timeout=30)", total, b, agreed)
    return agreed


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--ranks",
        type=int,
        default=3,
        help="Gloo ranks to run (3 or more: the group example uses ranks 1 and 2)",
    )
    args = parser.parse_args()
    if args.ranks < 3:
        parser.error(f"`--ranks` must be 3 or more, but is {args.ranks} instead.")
    results = run_world(side_by_side, args.ranks)
    agreed = dict.fromkeys(name for names in results for name in names)  # in order, once
    print(
        f"agang and c10d agree on {args.ranks} Gloo ranks, {len(agreed)} calls: {', '.join(agreed)}"
    )
