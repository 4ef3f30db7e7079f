"""Shared test set-up: every async test runs on asyncio, asyncio+uvloop and trio; tests
of many nodes (``tests/netns.py``) take the ``netns`` fixture."""

from __future__ import annotations

import pytest


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {"use_uvloop": False}), id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
        pytest.param(("trio", {}), id="trio"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, bool]]:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def netns() -> None:
    """Skips where namespaces cannot be made; clears what dead test runs left behind."""
    from netns import clean_leftovers, require_netns

    require_netns()
    clean_leftovers()
