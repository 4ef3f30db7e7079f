"""A process's own resources, for the leak tests: memory, threads and open fds."""

from __future__ import annotations

import gc
import os
import threading


def rss_kib() -> int:
    """This process's resident memory (VmRSS), in KiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def census() -> dict[str, int]:
    """This process's memory, Python threads, native threads (the kernel's count) and
    open fds, after a garbage collection (a cycle holding a socket is no leak)."""
    gc.collect()
    return {
        "rss_kib": rss_kib(),
        "threads": threading.active_count(),
        "native_threads": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),
    }
