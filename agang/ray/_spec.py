"""A gang of Ray actors as the driver plans it: ``GangSpec``, made by ``plan``.

Rules:
1. The spec is the actors' handles in rank order (rank = position in the list), the
   store's address, the gang's name and its deadlines. It is frozen and picklable (Ray
   passes handles through its serializer), so the driver gives the same spec to every
   actor, and each actor finds its rank by looking for its own handle in it (handles
   compare by actor id, whichever copy of them an actor holds).
2. Everything is checked on the driver, naming the parameter: no actor is started, and
   no network is touched, before the actors run ``join``.
3. The gang's keys live under ``agang/ray/NAME/PLAN`` of the store: the name keeps
   them apart from every other gang's of the job (so it is short and plain: letters,
   digits, ``.``, ``_``, ``-``), and the plan's own random id from an earlier plan's
   of the same name (a driver that plans "trainers" again after a failure, a store
   that outlives drivers), whose epochs would make every new actor wait as a joiner.
   A restarted actor is given the same spec, so it finds its gang's keys.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agang._membership import store as stores
from agang._setup.elastic import Elastic
from agang._validate import check_deadline

#: A set-up's deadline where ``plan`` is given none (seconds), as a weights channel's.
DEFAULT_TIMEOUT = 60.0
_NAME = re.compile(r"[A-Za-z0-9._-]{1,100}")


@dataclass(frozen=True)
class GangSpec:
    """A planned gang of Ray actors (rule 1); made by [`plan`][agang.ray.plan].

    Attributes:
        name: The gang's name (in errors, logs and the store's keys).
        store: The store's "HOST:PORT".
        actors: The members' handles; a member's rank is its position.
        timeout: Seconds ``join`` may take; None: no bound.
        op_timeout: The deadline of each op called without one, as given to ``plan``
            (None: agang's default, 300 s; ``math.inf``: none).
        elastic: An elastic gang's bounds, or None for a gang of exactly ``actors``.
        plan_id: This plan's random id (rule 3).
    """

    name: str
    store: str
    actors: tuple[Any, ...]
    timeout: float | None
    op_timeout: float | None
    elastic: Elastic | None
    plan_id: str = ""

    @property
    def size(self) -> int:
        """How many actors the gang is planned with."""
        return len(self.actors)

    @property
    def namespace(self) -> str:
        """The prefix of the gang's keys on the store (rule 3)."""
        return f"agang/ray/{self.name}/{self.plan_id}"

    def rank_of(self, actor: Any) -> int:
        """``actor``'s rank (rule 1); ValueError where it is not a member."""
        for rank, member in enumerate(self.actors):
            if member == actor:
                return rank
        raise ValueError(
            f"This actor ({actor!r}) is not a member of gang '{self.name}': its spec names "
            f"{', '.join(map(repr, self.actors))}. Pass the spec to the actors it was planned "
            f"with."
        )


def plan(
    actors: Sequence[Any],
    *,
    store: str,
    name: str = "gang",
    timeout: float | None = DEFAULT_TIMEOUT,  # join's deadline, carried
    op_timeout: float | None = None,
    elastic: Elastic | None = None,
    is_actor: Any = None,
) -> GangSpec:
    """Checks and bundles a gang of Ray actors (rule 2); see ``agang.ray.plan``."""
    if isinstance(actors, (str, bytes)) or not isinstance(actors, Sequence):
        raise TypeError(
            f"`actors` must be a list of Ray actor handles, but is of type "
            f"`{type(actors).__name__}` instead."
        )
    if not actors:
        raise ValueError("`actors` must name at least one actor, but is empty.")
    for index, actor in enumerate(actors):
        if is_actor is not None and not is_actor(actor):
            raise TypeError(
                f"`actors[{index}]` must be a Ray actor handle, but is of type "
                f"`{type(actor).__name__}` instead."
            )
    seen: dict[Any, int] = {}
    for index, actor in enumerate(actors):
        if actor in seen:
            raise ValueError(
                f"`actors` must name each actor once, but `actors[{index}]` is "
                f"`actors[{seen[actor]}]` again ({actor!r})."
            )
        seen[actor] = index
    stores.parse_address(store, name="store")
    given: object = name  # untyped callers
    if not isinstance(given, str) or not _NAME.fullmatch(given):
        raise ValueError(
            f"`name` must be 1 to 100 letters, digits, '.', '_' or '-', but is {name!r} instead."
        )
    if elastic is not None:
        if not isinstance(elastic, Elastic):
            raise TypeError(f"`elastic` must be an agang.Elastic or None, but is {elastic!r}.")
        if elastic.min_size > len(actors):
            raise ValueError(
                f"`elastic`'s min_size ({elastic.min_size}) must be at most the number of "
                f"`actors` ({len(actors)}): formation 0 takes those actors."
            )
        if elastic.max_size is not None and elastic.max_size < len(actors):
            raise ValueError(
                f"`elastic`'s max_size ({elastic.max_size}) must be at least the number of "
                f"`actors` ({len(actors)}): formation 0 takes them all."
            )
    seconds = check_deadline(timeout, name="timeout", default=DEFAULT_TIMEOUT)
    check_deadline(op_timeout, name="op_timeout", default=None)  # kept as given: join's policy
    return GangSpec(name, store, tuple(actors), seconds, op_timeout, elastic, secrets.token_hex(4))
