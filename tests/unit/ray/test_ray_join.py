"""``agang.ray.join`` and ``subscribe`` on fakes, without a cluster: the rank an actor
finds in its spec, what it forms and arms, and a cancel while arming (the gang or
subscriber made is closed, never left open). On asyncio, uvloop and trio."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from rayfakes import Handle

from agang.ray import _join
from agang.ray._spec import plan

pytestmark = pytest.mark.anyio


class Context:
    """Ray's runtime context, as an actor's method sees it."""

    def __init__(self, actor: Handle, name: str | None) -> None:
        self.current_actor = actor
        self._name = name

    def get_actor_id(self) -> str:
        return self.current_actor.actor_id

    def get_actor_name(self) -> str | None:
        return self._name


class Closable:
    """A gang or subscriber that says whether it was closed."""

    def __init__(self) -> None:
        self.closed = False

    async def close(self) -> None:
        self.closed = True


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Fakes for Ray's context, the formation, the watch and the subscriber."""
    record: dict[str, Any] = {"armed": True, "block": False, "expected": [], "made": []}

    async def form(**arguments: Any) -> Closable:
        record["form"] = arguments
        record["made"].append(Closable())
        return record["made"][-1]  # type: ignore[no-any-return]

    async def arm(store: str, what: str) -> bool:
        record["arm"] = (store, what)
        if record["block"]:
            await anyio.sleep_forever()
        return bool(record["armed"])

    async def open_subscriber(tensors: Any, **arguments: Any) -> Closable:
        record["open"] = arguments
        record["made"].append(Closable())
        return record["made"][-1]  # type: ignore[no-any-return]

    monkeypatch.setattr(_join.ray, "get_runtime_context", lambda: Context(Handle("b"), "rollout-1"))
    monkeypatch.setattr(_join.private_world, "form", form)
    monkeypatch.setattr(_join, "arm", arm)
    monkeypatch.setattr(_join, "expect_death_notices", record["expected"].append)
    monkeypatch.setattr(_join.WeightSubscriber, "open", open_subscriber)
    return record


SPEC = plan([Handle("a"), Handle("b"), Handle("c")], store="127.0.0.1:29500", name="t", timeout=9)


async def test_join_forms_this_actors_rank_and_arms_the_watch(seen: dict[str, Any]) -> None:
    gang = await _join.join(SPEC)
    form = seen["form"]
    assert (form["rank"], form["size"], form["name"]) == (1, 3, "t")
    assert form["namespace"] == SPEC.namespace
    assert (form["timeout"], form["store"]) == (9, "127.0.0.1:29500")
    assert seen["arm"] == ("127.0.0.1:29500", "gang 't'")
    assert seen["expected"] == [gang]  # a watcher reports its members' deaths


async def test_join_without_a_watch_expects_no_notices(seen: dict[str, Any]) -> None:
    seen["armed"] = False
    await _join.join(SPEC)
    assert seen["expected"] == []


async def test_join_cancelled_while_arming_closes_its_gang(seen: dict[str, Any]) -> None:
    seen["block"] = True
    with anyio.move_on_after(0.1) as scope:
        await _join.join(SPEC)
    assert scope.cancelled_caught
    assert [made.closed for made in seen["made"]] == [True]


async def test_subscribe_is_named_after_the_actor_and_closed_if_cancelled(
    seen: dict[str, Any],
) -> None:
    await _join.subscribe({}, store="127.0.0.1:29500", channel="policy")
    assert seen["open"]["name"] == "rollout-1"
    assert seen["arm"] == ("127.0.0.1:29500", "channel 'policy'")
    seen["block"] = True
    with anyio.move_on_after(0.1):
        await _join.subscribe({}, store="127.0.0.1:29500", channel="policy", name="own")
    assert seen["open"]["name"] == "own"
    assert [made.closed for made in seen["made"]] == [False, True]
