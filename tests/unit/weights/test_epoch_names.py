"""A weights epoch's gang names its ranks by member, never by the process's world roster.

An epoch's group is made outside the process's world (``agang._weights.epoch`` rule 1):
its rank 1 is a subscriber, while the process's own world (a trainer's gang) may have
a rank 1 of its own, somewhere else. An error of the epoch's gang must name the
subscriber, not that world rank.
"""

from __future__ import annotations

import pytest
import torch

from agang._backends.c10d import world as c10d_world
from agang._backends.c10d.backend import C10dBackend


@pytest.fixture
def world_with_a_roster() -> object:
    """The process's own world, as set-up publishes it: two ranks on other hosts."""
    before = c10d_world.current()
    c10d_world.publish(c10d_world.World(roster=("trainer0, pid 1", "trainer1, pid 2")))
    yield
    c10d_world.publish(before)


class _Group:
    """What a backend reads of its group when it is made: rank, size, name."""

    group_name = "weights:test"

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 2


def _backend(**how: object) -> C10dBackend:
    return C10dBackend(
        _Group(),  # type: ignore[arg-type]  # a duck-typed ProcessGroup
        device=torch.device("cpu"),
        kind="gloo",
        name="weights:test",
        is_world=False,
        registered=False,
        **how,  # type: ignore[arg-type]
    )


@pytest.mark.usefixtures("world_with_a_roster")
def test_a_group_with_a_roster_names_its_members_not_the_worlds_ranks() -> None:
    # Without a roster, a group outside the world is named from the world's roster:
    # what an epoch's gang did, naming the trainer's rank 1 for the subscriber.
    assert _backend().where(1) == "rank 1 (trainer1, pid 2)"
    backend = _backend(roster=["'publisher', host0, pid 10", "'server1', host1, pid 11"])
    assert backend.where(1) == "rank 1 ('server1', host1, pid 11)"
    assert backend.where(7) == "rank 7"  # not a member: no name made up
