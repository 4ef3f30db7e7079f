"""Fixtures of the in-process weights tests (``test_weights*.py``): the channel of
``tests/support/weightsworld.py``, and its beats shortened (a module takes them with
``pytest.mark.usefixtures("short_beats")``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest
from weightsworld import Channel, agang_threads

from agang._weights import channel as channel_keys
from agang._weights import fleet, upstream


@pytest.fixture
def short_beats(monkeypatch: pytest.MonkeyPatch) -> None:
    """Beats every 50 ms, not 200: opening and admission wait a beat; the silences
    that judge a member keep their lengths (``test_weights_rounds.py``'s ``quick``
    shortens those)."""
    for module in (channel_keys, fleet, upstream):
        monkeypatch.setattr(module, "BEAT", 0.05)


@pytest.fixture
async def channel() -> AsyncIterator[Channel]:
    """An in-process channel, closed at the end; closing must leave none of its
    threads behind (a gang's close may take a moment)."""
    before = agang_threads()
    opened = Channel()
    try:
        yield opened
    finally:
        await opened.close()
    for _ in range(100):
        left = {t.name for t in agang_threads() - before}
        if not left:
            break
        await anyio.sleep(0.05)
    assert not left, left
