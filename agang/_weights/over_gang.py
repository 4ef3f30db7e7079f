"""Opening a side of a channel that is a gang (a sharded trainer's): the steps every
rank takes together, so that every rank ends ``open`` the same way.

Rules:
1. Every rank reads its tensors' layouts (``agang._weights.sharding``) and checks its
   local tensors as a single side's are checked (``agang._weights.checks``); then the
   ranks exchange their verdicts, and where one rank's inputs are refused every rank
   raises the same ``ValueError``, naming that rank (a rank alone raising would leave
   the others waiting in a collective that never comes).
2. The plan is made from the global shapes (a ``DTensor``'s ``.shape``), so a sharded
   side and a whole one agree; every rank makes it, and the ranks' plans must be equal.
   Which tensors are tied comes from the local tensors' memory, rank 0's.
3. The gang's side talks over a lane of its own (``weights:CHANNEL#N``), the N-th
   opened on this gang for that channel in this process: every rank opens the same
   sides in the same order, so N agrees, and a side opened again after its lane went
   out of step gets a new one. Making a lane is a collective call: a rank waits for the
   others as long as its ``open`` may take, then raises ``GangInitError`` (``lanes``).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Mapping

import anyio
import torch

from agang._errors import GangInitError
from agang._gang import Gang
from agang._weights import checks
from agang._weights.plan import Plan
from agang._weights.sharding import Layout
from agang._weights.site import Site

#: Per gang, per channel, the lanes opened (rule 3).
_OPENED: weakref.WeakKeyDictionary[Gang, dict[str, int]] = weakref.WeakKeyDictionary()


def check_gang(gang: object) -> Gang:
    """``gang`` as a usable [`agang.Gang`][agang.Gang]."""
    if not isinstance(gang, Gang):
        raise TypeError(f"`gang` must be an agang.Gang, but is of type `{type(gang).__name__}`.")
    if gang.closed:
        raise ValueError(f"`gang` ('{gang.name}') is closed.")
    return gang


def layouts_of(tensors: object, gang: Gang) -> tuple[list[Layout], dict[str, torch.Tensor]]:
    """Each tensor's layout on this rank, and the local tensors, checked (rule 1)."""
    if not isinstance(tensors, Mapping):
        raise TypeError(
            f"`tensors` must be a mapping of names to tensors (a state_dict()), but is of "
            f"type `{type(tensors).__name__}` instead."
        )
    layouts = [Layout.of(str(name), value, gang.rank, gang.size) for name, value in tensors.items()]
    local = checks.check_tensors(
        {name: layout.local for name, layout in zip(tensors, layouts, strict=True)}
    )
    return layouts, local


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What both sides' ``open(gang=)`` take, checked on this rank (rule 1)."""

    channel: str
    seconds: float | None
    key: bytes | None
    layouts: list[Layout]
    local: dict[str, torch.Tensor]
    site: Site


def check_inputs(
    gang: Gang,
    tensors: object,
    store: object,
    channel: object,
    timeout: object,
    secret: object,
    who: str,
    site_of: Callable[[torch.device], Site] | None,
    default_timeout: float | None = None,
) -> Inputs:
    """This rank's inputs to a side's ``open(gang=)``, checked (rule 1); ``who`` is the
    side, in the store's messages; ``site_of`` gives the channel's site (agang's tests)."""
    host, port = checks.check_store(store)
    name = checks.check_channel(channel)
    seconds = checks.check_deadline(timeout, default=default_timeout)
    key = checks.check_secret(secret)
    layouts, local = layouts_of(tensors, gang)
    device = checks.device_of(local)
    if site_of is not None:
        site = site_of(device)
    else:
        site = Site.of(str(store), host, port, name, who, device)
    return Inputs(name, seconds, key, layouts, local, site)


def plan_of(names: list[str], layouts: list[Layout], bucket_bytes: int, transport: str) -> Plan:
    """The plan of the global tensors (rule 2)."""
    shapes = {
        name: torch.empty(layout.shape, dtype=layout.local.dtype, device="meta")
        for name, layout in zip(names, layouts, strict=True)
    }
    memory = {name: layout.local for name, layout in zip(names, layouts, strict=True)}
    return Plan.of(shapes, bucket_bytes, transport, memory=memory, split=True)


async def lanes(gang: Gang, channel: str, count: int, seconds: float, what: str) -> list[Gang]:
    """``count`` lanes of ``gang`` for the side of ``channel`` opened now (rule 3), made
    within ``seconds``, else ``GangInitError``: not every rank opened ``what``."""
    with anyio.move_on_after(seconds) as waited:
        made = [await gang.lane(lane_name(gang, channel)) for _ in range(count)]
    if waited.cancelled_caught:
        raise GangInitError(
            f"Not every rank of the gang '{gang.name}' opened {what} within {seconds:g} s: "
            f"`open` over a gang is a collective call."
        )
    return made


def lane_name(gang: Gang, channel: str) -> str:
    """The lane of the next side of ``channel`` opened on ``gang`` (rule 3)."""
    opened = _OPENED.setdefault(gang, {})
    opened[channel] = opened.get(channel, 0) + 1
    return f"weights:{channel}#{opened[channel]}"


async def agree(
    lane: Gang,
    verdict: str | None,
    plan: Plan | None,
    layouts: list[Layout],
    seconds: float | None,
) -> Plan | None:
    """Raises, on every rank, the first rank's refusal, or that the ranks' plans or ties
    differ (rules 1, 2); else the plan every rank uses: the global one, tied where the
    ranks that hold both tensors' bytes tie them (rule 2)."""
    empty = [layout.local.numel() == 0 for layout in layouts]
    aliases = None if plan is None else list(plan.aliases)
    mine = [verdict, None if plan is None else plan.fingerprint, aliases, empty]
    said = await lane.all_gather_objects(mine, timeout=seconds)
    for rank, (refusal, *_) in enumerate(said):
        if refusal is not None:
            raise ValueError(f"Rank {rank} of the gang '{lane.name}' was refused: {refusal}")
    assert plan is not None
    prints = [fingerprint for _, fingerprint, _, _ in said]
    if len(set(prints)) > 1:
        other = next(rank for rank, p in enumerate(prints) if p != prints[0])
        raise ValueError(
            f"The ranks of the gang '{lane.name}' hold different tensors: rank 0's plan "
            f"has the fingerprint {prints[0]}, rank {other}'s {prints[other]} (the same "
            f"names, order, global shapes and dtypes on every rank)."
        )
    agreed = []
    for index in range(len(plan.entries)):
        # The ranks whose shards of the tensor hold bytes say whether it is tied.
        holders = [rank for rank, (_, _, _, e) in enumerate(said) if not e[index]]
        ties = {said[rank][2][index] for rank in holders}
        if len(ties) > 1:
            raise ValueError(
                f"`tensors['{plan.entries[index][0]}']` is tied to another tensor on some "
                f"ranks of the gang '{lane.name}' and not on others: tie it on every rank, "
                f"or on none."
            )
        agreed.append(ties.pop() if ties else index)
    return dataclasses.replace(plan, aliases=tuple(agreed))


def following_bound(seconds: float | None) -> float:
    """How long a rank > 0 waits for rank 0's ``open`` (its store waits and a fence)."""
    return 2 * (60.0 if seconds is None else seconds) + 30.0
