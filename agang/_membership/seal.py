"""A membership's secret: the MAC that control records carry, so that a stranger who
reaches the store cannot write one that a member takes as its peers'.

The store (c10d's ``TCPStore``) has no authentication: anyone who reaches its port can
read and write every key. A feature that was given a secret seals each record it
writes and reads only records whose seal is valid; what a stranger writes is ignored
(logged once per reader), never acted on.

Rules:
1. A seal is an HMAC-SHA256 of the record's *key* and its value, so a record cannot be
   replayed under another key (a member list of epoch 3 is not one of epoch 4).
2. Text records carry their seal after the text (``" mac=<hex>"``, ``seal``/``open``).
3. ``SealedStore`` seals the raw values a process group's rendezvous writes (each
   member's network address, written and read by c10d's Gloo through the store), so a
   stranger cannot point a member's connection at an address of its own: a forged
   address fails the rendezvous instead of connecting to the stranger.
4. No secret: every record is taken as written (``Seal(None)`` passes text through).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from datetime import timedelta
from typing import Any, final

from torch.distributed import Store  # type: ignore[attr-defined]  # in c10d's stubs

log = logging.getLogger("agang.membership")

_TEXT_MARK = " mac="
_RAW_MARK = b"\x00agang-mac:"
_MAC_CHARS = 32


def is_sealed(value: str) -> bool:
    """Whether a text record carries a seal (rule 2)."""
    return _TEXT_MARK in value


@final
class Seal:
    """Seals and opens records with ``secret`` (rules 1, 2, 4)."""

    def __init__(self, secret: bytes | None, what: str) -> None:
        self.secret = secret
        self._what = what  # for the warning: whose records
        self._warned = False

    def mac(self, key: str, value: bytes) -> str:
        assert self.secret is not None
        digest = hmac.new(self.secret, key.encode() + b"\n" + value, hashlib.sha256)
        return digest.hexdigest()[:_MAC_CHARS]

    def seal(self, key: str, text: str) -> str:
        """``text`` with its seal (rule 2), or as it is without a secret."""
        if self.secret is None:
            return text
        return f"{text}{_TEXT_MARK}{self.mac(key, text.encode())}"

    def open(self, key: str, value: str | None, *, quiet: bool = False) -> str | None:
        """``value``'s text where its seal is valid (or there is no secret), else None
        (logged once, unless ``quiet``)."""
        if value is None or self.secret is None:
            return value
        text, mark, mac = value.rpartition(_TEXT_MARK)
        if mark and hmac.compare_digest(mac, self.mac(key, text.encode())):
            return text
        if not quiet:
            self.refused(key)
        return None

    def refused(self, key: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning(
                "agang: %s ignored a record under %s without a valid seal: written by "
                "someone without the secret (or with another one).",
                self._what,
                key,
            )


class SealedStore(Store):
    """``inner`` with every value sealed on the way in and checked on the way out
    (rule 3): a process group's rendezvous made on it takes no value a stranger wrote.

    Only the calls a rendezvous makes are sealed (``set``, ``get``, ``wait``, ``check``,
    ``add``, ``delete_key``); a value without a valid seal reads as an error, which
    fails the rendezvous.
    """

    def __init__(self, inner: Any, seal: Seal) -> None:
        super().__init__()
        assert seal.secret is not None
        self._inner = inner
        self._seal = seal

    def set(self, key: str, value: str | bytes) -> None:
        raw = value.encode() if isinstance(value, str) else bytes(value)
        mac = self._seal.mac(key, raw).encode()
        self._inner.set(key, raw + _RAW_MARK + mac)

    def get(self, key: str) -> bytes:
        value = bytes(self._inner.get(key))
        raw, mark, mac = value.rpartition(_RAW_MARK)
        if mark and hmac.compare_digest(mac, self._seal.mac(key, raw).encode()):
            return raw
        self._seal.refused(key)
        raise RuntimeError(
            f"the store's value under {key} has no valid seal: written by someone without "
            f"the membership's secret"
        )

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return bool(self._inner.check(keys))

    def add(self, key: str, amount: int) -> int:
        return int(self._inner.add(key, amount))

    def delete_key(self, key: str) -> bool:
        return bool(self._inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self._inner.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        self._inner.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        return self._inner.timeout  # type: ignore[no-any-return]
