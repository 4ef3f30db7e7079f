"""The member record both membership features keep in the store.

A member is one process taking part: a ``uid`` unique to that process and that
membership (a process that leaves and comes back, or that joins two channels, has a new
one each time), a ``name`` the feature gives it (an elastic member's launcher ``RANK``,
a weights subscriber's name in reports), and ``where`` it runs ("host, pid N"), which
every error that blames it quotes. In the store a member is one line: the three fields,
separated by single spaces, ``where`` last (it holds spaces; the others may not).
"""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class Member:
    """One process of a membership (module docstring)."""

    uid: str
    name: str
    where: str

    def __post_init__(self) -> None:
        for field, value in (("uid", self.uid), ("name", self.name)):
            if not value or any(c.isspace() for c in value):
                raise ValueError(
                    f"A member's `{field}` must be a non-empty str without spaces, but is "
                    f"{value!r} instead."
                )

    @staticmethod
    def here() -> str:
        """Where this process runs, as a member's ``where`` says it: "host, pid N"."""
        return f"{socket.gethostname()}, pid {os.getpid()}"

    @classmethod
    def me(cls, name: str) -> Member:
        """This process, under a new uid (host, pid and a random token)."""
        uid = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        return cls(uid, name, cls.here())

    def to_text(self) -> str:
        return f"{self.uid} {self.name} {self.where}"

    @classmethod
    def from_text(cls, text: str) -> Member:
        uid, name, where = text.split(" ", 2)
        return cls(uid, name, where)
