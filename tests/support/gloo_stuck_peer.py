"""Rank 1 of a two-rank Gloo group on the TCPStore at ``127.0.0.1:PORT``: it posts its
side of a broadcast of ``BYTES`` from rank 0, prints "posted", and waits (at most
``WAIT_SECONDS``) for the test to stop or kill it, so that rank 0's send is caught
mid-write (``tests/gloo/test_abort_stuck_send.py``).

    python gloo_stuck_peer.py PORT BYTES
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

WAIT_SECONDS = 120.0


def main() -> None:
    port, num_bytes = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=30))
    group = dist.ProcessGroupGloo(store, 1, 2, timedelta(seconds=WAIT_SECONDS))
    options = dist.BroadcastOptions()
    options.rootRank = 0
    work = group.broadcast([torch.zeros(num_bytes // 4)], options)
    print("posted", flush=True)
    time.sleep(WAIT_SECONDS)
    del work


if __name__ == "__main__":
    main()
