"""Order checks and the census on c10d: fingerprints compared on a side Gloo group.

Rules:
1. Each rank's 8-byte digest of its fingerprint is gathered on a side Gloo group (so a
   check never queues behind the ops it guards); only on a mismatch are the
   fingerprints' texts exchanged, through the store, on a thread.
2. The exchange polls the store (``check``), never a blocking ``get``: a blocking get
   holds the store client's lock while it waits, so two exchanges at once (two
   mismatched positions, or two gangs) could deadlock across ranks.
3. The census asks, through the store, which ranks have not reached a check: each rank
   stuck there says so under a key of its own, and whoever has not said so within
   ``CENSUS_SECONDS`` is named absent (the stuck ranks time out at about the same
   moment, so that is enough for them to speak).
4. The census answers within ``CENSUS_BOUND`` whatever the store does: a deadline waits
   for it, and a store whose host is stopped would otherwise hold the answer (and the
   timeout) until the store client's own timeout, many times the deadline. Past the
   bound it answers None (unknown); the thread that asked may stay blocked (exit waits
   for it within its bound: a thread inside c10d when the interpreter ends aborts it).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from agang._backends.contract import Census, Checked
from agang._offload import start_thread

log = logging.getLogger("agang")

CENSUS_SECONDS = 0.25
CENSUS_BOUND = CENSUS_SECONDS + 0.25

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def start_order_check(
    order_group: dist.ProcessGroup,
    *,
    rank: int,
    size: int,
    name: str,
    index: int,
    fingerprint: str,
    checked: Checked,
    give_up: Callable[[], bool],
) -> None:
    """Compares the ``index``-th fingerprint across ranks (rules 1 and 2).

    ``give_up`` says the gang no longer waits (it broke or closed).
    """
    digest = hashlib.blake2b(fingerprint.encode(), digest_size=8).digest()
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)])
    gathered = torch.empty(size, dtype=torch.int64)
    work = all_gather_flat(gathered, mine, group=order_group, async_op=True)

    def on_gathered(future: Any) -> None:
        try:
            future.value()
        except Exception as exc:
            checked(None, exc)
            return
        digests = gathered.tolist()
        if len(set(digests)) == 1:
            checked(None, None)
            return
        prefix = f"agang/order/{name}/{index}"
        _ = start_thread(
            lambda: _exchange(prefix, rank, fingerprint, digests, checked, give_up),
            name=f"order mismatch on '{name}'",
        )

    work.get_future().add_done_callback(on_gathered)


def _exchange(
    prefix: str,
    rank: int,
    fingerprint: str,
    digests: list[int],
    checked: Checked,
    give_up: Callable[[], bool],
) -> None:
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{prefix}/{rank}", fingerprint)
        texts: dict[int, str] = {}
        for digest in dict.fromkeys(digests):  # one rank per distinct fingerprint
            ranks = [r for r, d in enumerate(digests) if d == digest]
            key = f"{prefix}/{ranks[0]}"
            if rank in ranks:
                text = fingerprint
            else:
                if not _await_key(store, key, give_up):
                    return  # the gang broke or closed meanwhile: nobody is waiting
                text = store.get(key).decode()
            texts.update(dict.fromkeys(ranks, text))
    except Exception as exc:
        checked(None, exc)
        return
    checked(texts, None)


def _await_key(store: Any, key: str, give_up: Callable[[], bool]) -> bool:
    while not store.check([key]):  # rule 2
        if give_up():
            return False
        time.sleep(0.002)
    return True


def start_census(
    group_name: str, *, rank: int, size: int, name: str, index: int, report: Census
) -> None:
    """Reports the ranks that had not reached the ``index``-th check (rule 3)."""
    # Keyed by c10d's group name: equal on every rank, and unique for the store's life.
    prefix = f"agang/census/{group_name}/{index}"
    lock = threading.Lock()
    reported = False

    def once(absent: list[int] | None) -> None:  # rule 4: the first answer counts
        nonlocal reported
        with lock:
            if reported:
                return
            reported = True
        report(absent)

    timer = threading.Timer(CENSUS_BOUND, once, args=(None,))
    timer.daemon = True
    timer.start()
    _ = start_thread(
        lambda: once(_absent_from_check(prefix, rank, size, name)),
        name=f"census '{name}'",
    )


def _absent_from_check(prefix: str, rank: int, size: int, name: str) -> list[int] | None:
    keys = [f"{prefix}/{r}" for r in range(size)]
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(keys[rank], "1")
        give_up_at = time.monotonic() + CENSUS_SECONDS
        while True:
            absent = [r for r, key in enumerate(keys) if not store.check([key])]
            if not absent or time.monotonic() >= give_up_at:
                return absent
            time.sleep(0.01)
    except Exception:
        log.debug("The order-check census of gang '%s' failed.", name, exc_info=True)
        return None
