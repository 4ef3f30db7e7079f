"""The private world agang.ray forms, without Ray: real Gloo processes around an
``agang store``, on asyncio, uvloop and trio. The gang takes no default group, sums
exactly, and a death notice naming a member fails the others' pending op at once."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import pytest
from storeutil import SUPPORT, Lines, clean_env

import agang

pytestmark = pytest.mark.timeout(120)
LOOPS = ["asyncio", "uvloop", "trio"]


def start(
    started: list[subprocess.Popen[str]], store: str, rank: int, loop: str, *extra: str
) -> Lines:
    process = subprocess.Popen(
        [sys.executable, str(SUPPORT / "privateworld.py"), store, str(rank), "3", loop, *extra],
        stdout=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    started.append(process)
    return Lines(process.stdout)


def event(lines: Lines, name: str) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(lines.wait_for(f'"event": "{name}"', 60))
    return found


@pytest.mark.parametrize("loop", LOOPS)
def test_a_private_world_is_exact_and_leaves_the_default_group(
    started: list[subprocess.Popen[str]], store: str, loop: str
) -> None:
    ranks = [start(started, store, rank, loop) for rank in range(3)]
    joined = [event(lines, "joined") for lines in ranks]
    assert [j["rank"] for j in joined] == [0, 1, 2]
    assert not any(j["default_group"] for j in joined)
    for lines in ranks:  # a second world in the process is refused before anything
        assert "one process has one world gang" in event(lines, "refused")["message"]
    assert [event(lines, "result")["value"] for lines in ranks] == [[6.0] * 4] * 3
    assert [event(lines, "result")["value"] for lines in ranks] == [[3.0] * 4] * 3


@pytest.mark.parametrize("loop", LOOPS)
def test_a_death_notice_fails_the_others_pending_op_at_once(
    started: list[subprocess.Popen[str]], store: str, loop: str
) -> None:
    ranks = [
        start(started, store, rank, loop, *(["--idle"] if rank == 2 else [])) for rank in range(3)
    ]
    joined = [event(lines, "joined") for lines in ranks]
    # Ranks 0 and 1 sum twice; the second waits on rank 2, which never comes.
    for lines in ranks:
        event(lines, "result")
    time.sleep(0.5)
    told = agang.report_death_sync(store, joined[2]["where"], "the test's watcher saw it die")
    assert told >= 2
    reported = time.time()
    for lines in ranks[:2]:
        failed = event(lines, "failed")
        assert "rank 2" in failed["message"], failed
        assert "the test's watcher saw it die" in failed["message"], failed
        assert failed["at"] - reported < 10.0  # the op's deadline is 60 s


@pytest.mark.parametrize("loop", LOOPS)
def test_a_mismatch_is_found_on_the_private_worlds_own_store(
    started: list[subprocess.Popen[str]], store: str, loop: str
) -> None:
    # Order checks (on over Gloo) compare texts on the world's store: a private world
    # has no default group, and must not need one.
    ranks = [start(started, store, rank, loop, "--mismatch") for rank in range(3)]
    for lines in ranks:
        failed = event(lines, "failed")
        assert failed["kind"] == "CollectiveMismatchError", failed
        assert "all_reduce" in failed["message"], failed
        assert "broadcast" in failed["message"], failed
