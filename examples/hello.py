"""Hello, agang: a few awaited collectives on every rank.

Run on one process (an in-process gang, no network):
    python examples/hello.py
or on three local ranks:
    torchrun --standalone --nproc-per-node 3 examples/hello.py
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import time

import torch

import agang


async def main(init_timeout: float, op_timeout: float) -> None:
    gang = await agang.init(timeout=init_timeout, op_timeout=op_timeout)
    rank, size = gang.rank, gang.size
    try:
        # Issued at the call; the sleep below overlaps the communication.
        handle = gang.all_reduce(torch.full((4,), float(rank + 1)))
        await asyncio.sleep(0.01)
        total = await handle

        mine = torch.tensor([rank, rank * 10.0])
        gathered = await gang.all_gather(torch.empty(size, 2), mine)
        my_rank = torch.tensor([float(rank)])
        mean = await gang.all_reduce(my_rank, agang.ReduceOp.MEAN)
        host = socket.gethostname()
        hosts = await gang.all_gather_objects(f"{host}/rank{rank}")
        config = await gang.broadcast_objects(
            [{"lr": 3e-4, "started": time.time()}] if rank == 0 else [None]
        )
        await gang.barrier()

        expected = size * (size + 1) / 2
        assert total.tolist() == [expected] * 4, total
        ranks = list(map(float, range(size)))
        assert gathered[:, 0].tolist() == ranks, gathered
        if rank == 0:
            stats = gang.statistics()
            print(f"agang hello: {size} rank(s) on {gang.backend}")
            got = total[0].item()
            print(f"  all_reduce of 1..{size}: {got:g} (expected {expected:g})")
            print(f"  all_gather: {gathered[:, 1].tolist()}")
            print(f"  mean of ranks: {mean.item():g}")
            print(f"  ranks: {', '.join(hosts)}")
            print(f"  config from rank 0: lr={config[0]['lr']}")
            print(
                f"  {stats.num_completed} ops completed, median latency "
                f"{1e3 * (stats.latency_p50 or 0):.2f} ms"
            )
    finally:
        await gang.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds to form the gang",
    )
    parser.add_argument(
        "--op-timeout",
        type=float,
        default=30.0,
        help="each op's deadline (s)",
    )
    args = parser.parse_args()
    asyncio.run(main(args.timeout, args.op_timeout))
