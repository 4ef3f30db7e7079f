"""A stand-in for a Ray actor handle, for the fast lane's tests of ``agang.ray``
(``tests/unit/ray``): hashable and compared by actor id, as Ray's handles are."""

from __future__ import annotations


class Handle:
    """An actor handle's stand-in (module docstring)."""

    def __init__(self, actor_id: str) -> None:
        self.actor_id = actor_id

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Handle) and other.actor_id == self.actor_id

    def __hash__(self) -> int:
        return hash(self.actor_id)

    def __repr__(self) -> str:
        return f"Handle({self.actor_id})"
