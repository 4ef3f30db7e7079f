"""agang on Ray: gangs and weight fleets of Ray actors, with deaths told by Ray.

Needs the extra ``agang[ray]``; plain ``import agang`` never imports Ray.

- ``store()`` (driver): gets or starts the job's store and death watcher, an actor
  owned by the driver; returns "HOST:PORT".
- ``plan(actors, store=...)`` (driver): a picklable ``GangSpec``; rank = position.
- ``Member``: a mixin for the actors' classes that lets agang watch their deaths.
- ``join(spec)`` (inside each async actor): the gang, never the default group.
- ``subscribe(tensors, store=..., channel=...)`` (inside an actor): a weights
  subscriber named after the actor.
- ``death_notices()`` (driver): what the watcher told of each death Ray reported.

agang never creates, places, restarts, scales or kills an actor, and uses no private
module of Ray's.
"""

from __future__ import annotations

try:
    import ray as _ray  # noqa: F401  # the extra's one dependency, checked here
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("agang.ray needs Ray: pip install 'agang[ray]'.") from error

from typing import Any

from agang._setup.elastic import Elastic
from agang.ray._join import join, subscribe
from agang.ray._member import Member
from agang.ray._spec import DEFAULT_TIMEOUT, GangSpec
from agang.ray._spec import plan as _plan
from agang.ray._store import death_notices, store

__all__ = ["GangSpec", "Member", "death_notices", "join", "plan", "store", "subscribe"]


def plan(
    actors: Any,
    *,
    store: str,
    name: str = "gang",
    timeout: float | None = DEFAULT_TIMEOUT,  # join's deadline, carried
    op_timeout: float | None = None,
    elastic: Elastic | None = None,
) -> GangSpec:
    """Plans a gang of Ray actors, on the driver: checks everything, starts nothing.

    Args:
        actors: The members' handles, in rank order (rank = position at formation
            0; a reform keeps the survivors' order and appends the joiners).
        store: The store's "HOST:PORT" ([`store`][agang.ray.store]'s).
        name: The gang's name: 1 to 100 letters, digits, '.', '_' or '-'; gangs of one
            job have different names.
        timeout: Seconds ``join`` may take (None: 60 s; ``math.inf``: no bound); a
            ``reform()`` takes its own ``timeout``.
        op_timeout: The deadline of each op called without one (None: agang's default,
            300 s; ``math.inf``: none).
        elastic: An elastic gang's bounds ([`agang.Elastic`][agang.Elastic]), or None
            for a gang of exactly ``actors``.

    Returns:
        The picklable spec to pass to every actor's [`join`][agang.ray.join].

    Raises:
        TypeError: ``actors`` is not a list of actor handles.
        ValueError: An argument is invalid (the message names it).

    Example:
        <!-- not-run: needs a Ray cluster -->
        ```python
        spec = agang.ray.plan([a, b], store=agang.ray.store(), name="trainers")
        ray.get([a.train.remote(spec), b.train.remote(spec)])
        ```
    """
    from ray.actor import ActorHandle

    return _plan(
        actors,
        store=store,
        name=name,
        timeout=timeout,
        op_timeout=op_timeout,
        elastic=elastic,
        is_actor=lambda actor: isinstance(actor, ActorHandle),
    )
