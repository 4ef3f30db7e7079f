"""Inside an actor: joining a planned gang (``join``) and a weights channel
(``subscribe``).

Rules:
1. ``join`` forms the actor's private world (``agang._setup.private_world``): its
   groups are registered nowhere, so the actor's default process group, if it made
   one, stays its own; its keys live under the gang's namespace of the job's store.
   A gang planned without ``elastic`` is one of exactly its actors: rank = position in
   the plan; after a loss its members may ``reform()``, which admits the lost actor's
   restarted incarnation (it calls ``join`` again, as a joiner) and no one else.
2. Once in, the actor has the job's keeper watch it (``agang.ray._keeper``, rule 2):
   its death, as Ray reports it, fails its peers' pending ops at once, with blame that
   names it and says Ray's why.
3. Cancelling ``join`` or ``subscribe`` is safe: while forming, as
   ``private_world``'s rule 3 says; while arming the watch, the gang (or subscriber)
   is closed before the cancel goes on.
4. ``subscribe`` is ``WeightSubscriber.open`` named after the actor (Ray keeps an
   actor's name across restarts, so a restarted server reopens under its name and is
   admitted at the next push), then rule 2's watch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import anyio
import ray
import torch

from agang._gang import Gang
from agang._setup import private_world
from agang._setup.elastic_gang import expect_death_notices
from agang._weights.subscriber import WeightSubscriber
from agang.ray._spec import GangSpec
from agang.ray._store import arm


async def join(spec: GangSpec, *, device: torch.device | str | None = None) -> Gang:
    """Joins the gang ``spec`` plans, from inside one of its actors (an async actor).

    The gang is this process's world gang, over groups registered nowhere: the
    actor's own ``torch.distributed`` world, if any, stays its own. Call it in every
    actor of the spec (a restarted one, to rejoin an elastic gang).

    Args:
        spec: What [`plan`][agang.ray.plan] made on the driver.
        device: The gang's device (None: the actor's GPU where Ray gave it one, else
            the CPU): Gloo on the CPU, NCCL on a GPU.

    Returns:
        The gang ([`agang.ElasticGang`][agang.ElasticGang]; rank = position in the plan
        at formation 0).

    Raises:
        GangInitError: The members did not all come within the spec's ``timeout``, or
            this process's world gang is already open.
        TypeError: ``spec`` is not a ``GangSpec``.
        RuntimeError: Not called inside a Ray actor.
        ValueError: This actor is not in ``spec``, or ``device`` is invalid.

    Example:
        <!-- not-run: needs a Ray cluster -->
        ```python
        gang = await agang.ray.join(spec)
        await gang.all_reduce(grads)
        ```
    """
    if not isinstance(spec, GangSpec):
        raise TypeError(
            f"`spec` must be an agang.ray.GangSpec (from agang.ray.plan), but is of type "
            f"`{type(spec).__name__}` instead."
        )
    context = ray.get_runtime_context()
    if context.get_actor_id() is None:
        raise RuntimeError("agang.ray.join() must be called inside a Ray actor.")
    gang = await private_world.form(
        store=spec.store,
        rank=spec.rank_of(context.current_actor),
        size=spec.size,
        namespace=spec.namespace,
        name=spec.name,
        timeout=spec.timeout,
        op_timeout=spec.op_timeout,
        elastic=spec.elastic,
        device=device,
    )
    try:
        if await arm(spec.store, f"gang '{spec.name}'"):  # rule 2
            expect_death_notices(gang)
    except BaseException:  # rule 3: a gang nobody will hold is not left open
        with anyio.CancelScope(shield=True):
            await gang.close()
        raise
    return gang


async def subscribe(
    tensors: Mapping[str, torch.Tensor],
    *,
    store: str,
    channel: str,
    name: str | None = None,
    **options: Any,
) -> WeightSubscriber:
    """[`WeightSubscriber.open`][agang.WeightSubscriber.open] from inside an actor, named
    after the actor (rule 4), and watched (its death drops it from the push at once).

    Args:
        tensors: As ``WeightSubscriber.open``'s.
        store: The store's "HOST:PORT" (``agang.ray.store()``'s).
        channel: The channel's name.
        name: The subscriber's name in reports (None: the actor's name, else its id).
        **options: ``WeightSubscriber.open``'s other keywords (``timeout``,
            ``in_place``, ``secret``).

    Example:
        <!-- not-run: needs a Ray cluster -->
        ```python
        sub = await agang.ray.subscribe(model.state_dict(), store=store, channel="policy")
        ```
    """
    context = ray.get_runtime_context()
    if context.get_actor_id() is None:
        raise RuntimeError("agang.ray.subscribe() must be called inside a Ray actor.")
    chosen = name if name is not None else (context.get_actor_name() or context.get_actor_id())
    subscriber = await WeightSubscriber.open(
        tensors, store=store, channel=channel, name=chosen, **options
    )
    try:
        await arm(store, f"channel '{channel}'")
    except BaseException:  # a subscriber nobody will hold is not left open
        with anyio.CancelScope(shield=True):
            await subscriber.close()
        raise
    return subscriber
