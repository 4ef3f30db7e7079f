"""Shared test set-up: every async test runs on asyncio, asyncio+uvloop and trio; tests
of many nodes (``tests/support/netns.py``) take the ``netns`` fixture.

The helper modules in ``tests/support`` are importable by name from every test (and from
the ranks that ``run_world`` spawns, which inherit ``sys.path``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agang._engine import busy

TESTS = Path(__file__).resolve().parent
SUPPORT = TESTS / "support"
if str(SUPPORT) not in sys.path:
    sys.path.insert(0, str(SUPPORT))
# Tests that start processes (Gloo ranks, subprocesses, namespaces) or need a GPU.
SLOW_FOLDER = TESTS / "gloo"
SLOW_MARKERS = ("gloo", "cuda")


# What a run is, for its header: keep the timings in step with the suite.
LANES = (
    "agang's tests: every async test runs on asyncio, asyncio+uvloop and trio.",
    '  fast lane, -m "not slow": in process only (tests/unit, tests/world), about 115 s '
    "on 2 cores;",
    "  the full suite adds the slow tests (tests/gloo and every gloo or cuda test: real "
    "processes, network namespaces, a local Ray cluster, GPUs): about 15 minutes on a "
    "2-core machine.",
    "  cuda tests skip without a GPU, namespace tests without root; -rs says why.",
)


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Says what the run is: its lanes, what each costs, the loops, and this run's lane."""
    selected = config.getoption("markexpr", "") or ""
    if selected.replace("'", '"') == "not slow":
        lane = "the fast lane"
    elif not selected:
        lane = "the full suite (or the paths given)"
    else:
        lane = f'-m "{selected}"'
    return [*LANES, f"  this run: {lane}."]


def pytest_report_collectionfinish(config: pytest.Config, items: list[pytest.Item]) -> str:
    """How many tests the run holds, fast and slow (without xdist; with it, the workers
    collect, and xdist's own line gives the total)."""
    slow = sum(1 for item in items if item.get_closest_marker("slow"))
    return f"{len(items)} tests selected: {len(items) - slow} fast, {slow} slow."


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks ``slow`` every test under ``tests/gloo`` and every ``gloo`` or ``cuda`` test
    wherever it lives, so that ``-m "not slow"`` is the fast lane: in process only."""
    for item in items:
        in_slow_folder = item.path.is_relative_to(SLOW_FOLDER)
        if in_slow_folder or any(item.get_closest_marker(name) for name in SLOW_MARKERS):
            item.add_marker(pytest.mark.slow)


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


@pytest.fixture(autouse=True)
def no_memory_left_busy() -> Iterator[None]:
    """Fails a test that ends with memory still held by one of its ops (a gang left open
    with an op pending): the claim is process-wide and would make a later test, run by
    the same worker, fail in its stead."""
    before = busy.num_busy()
    yield
    left = busy.num_busy() - before
    assert left <= 0, (
        f"the test left {left} busy range(s) behind: close the gangs whose ops it left pending"
    )


@pytest.fixture(scope="module")
def control() -> Iterator[Any]:
    """The control connection of ``tests/support/elasticrun.py``'s clusters, one per
    module (its workers are the module's)."""
    from elasticrun import Control

    control = Control()
    try:
        yield control
    finally:
        control.close()
