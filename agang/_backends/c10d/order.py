"""Order checks on c10d: fingerprints compared on a side Gloo group.

Rules:
1. Each rank's 8-byte digest of its fingerprint's op, and its balance of split sizes
   (``agang._backends.fingerprint``: 0 for an op without them), are gathered on a side
   Gloo group (so a check never queues behind the ops it guards); only where the ops
   differ are their texts exchanged, through the store, on a thread, one per distinct op.
2. The exchange polls the store (``check``), never a blocking ``get``: a blocking get
   holds the store client's lock while it waits, so two exchanges at once (two
   mismatched positions, or two gangs) could deadlock across ranks.
3. When only the split sizes disagree (same op, balances that do not cancel), the
   ranks' texts differ, and every rank fetching every other's would make the store
   carry the gang's size squared of them. So rank 0 alone reads them all and posts the
   texts of the ranks in the first disagreeing pairs
   (``agang._backends.fingerprint.named``), which the others read. Never a collective on
   the side group: a later op's check may already be in flight there, on some ranks and
   not others.
4. Which ranks never reached a check, when a deadline passes in it, is the blame's to
   say (``mailbox``): a rank that has not issued the op has not reached its check.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from agang._backends.c10d import world as c10d_world
from agang._backends.c10d.calls import all_gather_flat
from agang._backends.contract import Checked
from agang._backends.fingerprint import balance, balanced, named, split
from agang._runtime.threads import start_thread

_INT64 = struct.Struct("=q")  # native order, as torch.frombuffer reads it


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
    """Compares the ``index``-th fingerprint across ranks (rules 1 to 3).

    ``give_up`` says the gang no longer waits (it broke or closed).
    """
    op, _ = split(fingerprint)
    # The digest's 8 bytes and the balance, as two int64s (rule 1), built from bytes and
    # gathered on the group itself rather than through torch.distributed's wrappers: a
    # check is issued on the event loop's thread for every op, so it is kept lean.
    digest = hashlib.blake2b(op.encode(), digest_size=8).digest()
    mine = torch.frombuffer(
        bytearray(digest + _INT64.pack(balance(rank, fingerprint))), dtype=torch.int64
    )
    gathered = torch.empty(2 * size, dtype=torch.int64)
    work = all_gather_flat(order_group, gathered, mine)

    def on_gathered(future: Any) -> None:
        try:
            future.value()
        except Exception as exc:
            checked(None, exc)
            return
        values = gathered.tolist()
        ops, balances = values[0::2], values[1::2]
        if len(set(ops)) > 1:
            prefix = f"agang/order/{name}/{index}"
            _ = start_thread(
                lambda: _exchange(prefix, rank, op, ops, checked, give_up),
                name=f"order mismatch on '{name}'",
            )
        elif not balanced(balances):
            prefix = f"agang/order/{name}/{index}"
            _ = start_thread(
                lambda: _exchange_flows(prefix, rank, size, fingerprint, checked, give_up),
                name=f"split sizes mismatch on '{name}'",
            )
        else:
            checked(None, None)

    work.get_future().add_done_callback(on_gathered)


def _shared_store() -> Any:
    """The world's store (an elastic epoch's or a private world's, else the default
    group's): a private world has no default group, and one the user made is theirs."""
    store = c10d_world.shared_store()
    if store is None:
        raise RuntimeError("The world has no store to compare fingerprints on.")
    return store


def _exchange_flows(
    prefix: str,
    rank: int,
    size: int,
    fingerprint: str,
    checked: Checked,
    give_up: Callable[[], bool],
) -> None:
    """Only the split sizes disagree (rule 3): every rank posts its text; rank 0 reads
    them all and posts those of the ranks in the first disagreeing pairs; the others
    read that one report."""
    try:
        store = _shared_store()
        store.set(f"{prefix}/{rank}", fingerprint)
        report = f"{prefix}/report"
        if rank == 0:
            texts = {0: fingerprint}
            for peer in range(1, size):
                if not _await_key(store, f"{prefix}/{peer}", give_up):
                    return  # the gang broke or closed meanwhile: nobody is waiting
                texts[peer] = store.get(f"{prefix}/{peer}").decode()
            kept = named(texts)
            store.set(report, json.dumps(kept))
        else:
            if not _await_key(store, report, give_up):
                return
            kept = {int(r): text for r, text in json.loads(store.get(report)).items()}
    except Exception as exc:
        checked(None, exc)
        return
    checked(kept, None)


def _exchange(
    prefix: str,
    rank: int,
    fingerprint: str,
    digests: list[int],
    checked: Checked,
    give_up: Callable[[], bool],
) -> None:
    try:
        store = _shared_store()
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
