"""The public surface: what ``agang`` and ``agang.testing`` export, and nothing more.

A change here is a change of the API: it should be deliberate, not a side effect.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import pkgutil
import types

import pytest

import agang
import agang.testing
from agang.testing import FakeWorldGang

AGANG_API = {
    "init",
    "init_sync",
    "WorldInfo",
    "RetryPolicy",
    "Gang",
    "ProcessGroupGang",
    "FakeGang",
    "Handle",
    "ReduceOp",
    "GangStatistics",
    "Coalesced",
    "GradientSync",
    "StepTimes",
    "Quantiles",
    "InFlightLimits",
    "Gangs",
    "create_parallel_gangs",
    "create_fsdp_gangs",
    "current_gangs",
    "broadcast_flag",
    "all_sum",
    "GangError",
    "GangInitError",
    "GangClosedError",
    "GangBrokenError",
    "GangInheritedError",
    "CollectiveError",
    "GangTimeoutError",
    "TensorBusyError",
    "GangFullError",
    "CollectiveMismatchError",
    "OpContext",
    "Elastic",
    "ElasticGang",
    "report_death",
    "report_death_sync",
    "WeightPublisher",
    "WeightSubscriber",
    "PushReport",
    "Sharded",
}

TESTING_API = {
    "FakeWorld",
    "FakeWorldGang",
    "SimulatedNccl",
    "WorldRunError",
    "reduce_tensors",
    "run_world",
    "use_simulated_nccl",
}

PACKAGES = [(agang, AGANG_API), (agang.testing, TESTING_API)]

COLLECTIVES = [
    "all_reduce",
    "all_gather",
    "all_gather_to_list",
    "reduce_scatter",
    "broadcast",
    "broadcast_objects",
    "all_gather_objects",
    "all_to_all",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    "exchange",
    "barrier",
]


def public_names(module: types.ModuleType) -> set[str]:
    """The public names ``dir(module)`` lists, apart from its subpackages: agang's own
    ``__dir__`` lists the names it loads on first use as well as those bound so far."""
    return {
        name
        for name in dir(module)
        if not name.startswith("_") and not isinstance(getattr(module, name), types.ModuleType)
    }


@pytest.mark.parametrize(("package", "expected"), PACKAGES, ids=["agang", "agang.testing"])
def test_all_lists_exactly_the_exports(package: types.ModuleType, expected: set[str]) -> None:
    assert len(package.__all__) == len(set(package.__all__)), "a name is listed twice"
    assert set(package.__all__) == expected
    assert public_names(package) == expected


@pytest.mark.parametrize(("package", "expected"), PACKAGES, ids=["agang", "agang.testing"])
def test_star_import_gives_exactly_all(package: types.ModuleType, expected: set[str]) -> None:
    namespace: dict[str, object] = {}
    exec(f"from {package.__name__} import *", namespace)

    assert set(namespace) - {"__builtins__"} == expected


@pytest.mark.parametrize(("package", "expected"), PACKAGES, ids=["agang", "agang.testing"])
def test_exports_are_re_exported_from_private_modules(
    package: types.ModuleType, expected: set[str]
) -> None:
    for name in expected:
        value = getattr(package, name)
        module = value.__module__
        # A testing tool may live below the testing package, where set-up uses it too
        # (``reduce_tensors``: the simulated NCCL's kernels, under ``agang._backends``).
        private = module.startswith((f"{package.__name__}._", "agang._"))
        assert private, f"{name} is defined in {module}"
        assert inspect.getdoc(value), f"{name} has no docstring"


def test_implementation_modules_are_private() -> None:
    import agang.ray  # the extra's package: its own modules are private too

    for package in (agang, agang.testing, agang.ray):
        for module in pkgutil.iter_modules(package.__path__):
            assert module.name.startswith("_") or module.name in ("testing", "ray"), module.name
            importlib.import_module(f"{package.__name__}.{module.name}")


def test_version_matches_the_installed_metadata() -> None:
    assert agang.__version__ == importlib.metadata.version("agang")


@pytest.mark.parametrize(
    ("error", "bases"),
    [
        (agang.GangError, (Exception,)),
        (agang.GangInitError, (agang.GangError,)),
        (agang.GangClosedError, (agang.GangError,)),
        (agang.GangBrokenError, (agang.GangError,)),
        (agang.GangInheritedError, (agang.GangError,)),
        (agang.CollectiveError, (agang.GangError,)),
        (agang.GangTimeoutError, (agang.CollectiveError, agang.GangError, TimeoutError)),
        (agang.TensorBusyError, (agang.GangError, ValueError)),
        (agang.testing.WorldRunError, (agang.GangError,)),
    ],
)
def test_error_hierarchy(error: type[Exception], bases: tuple[type[Exception], ...]) -> None:
    for base in bases:
        assert issubclass(error, base)


def test_closed_and_broken_are_not_timeouts_or_bad_input() -> None:
    for error in (agang.GangClosedError, agang.GangBrokenError, agang.GangInitError):
        assert not issubclass(error, TimeoutError | ValueError | TypeError)


def test_gang_is_an_abstract_interface_with_every_collective() -> None:
    assert inspect.isabstract(agang.Gang)
    for name in [
        *COLLECTIVES,
        "create_gang",
        "lane",
        "wait_for_room",
        "close",
        "close_sync",
        "statistics",
    ]:
        assert name in agang.Gang.__abstractmethods__, name
    for name in ["rank", "size", "device", "backend", "name", "closed"]:
        assert isinstance(inspect.getattr_static(agang.Gang, name), property), name


@pytest.mark.parametrize("name", COLLECTIVES)
def test_collectives_are_plain_methods_that_return_a_handle(name: str) -> None:
    # Issue at call, complete at await: the method itself never waits.
    method = getattr(agang.Gang, name)

    assert not inspect.iscoroutinefunction(method)
    assert "Handle[" in str(inspect.signature(method).return_annotation)
    assert "timeout" in inspect.signature(method).parameters


@pytest.mark.parametrize("name", ["create_gang", "lane", "wait_for_room", "close"])
def test_calls_that_can_wait_are_async(name: str) -> None:
    assert inspect.iscoroutinefunction(getattr(agang.Gang, name))


@pytest.mark.parametrize("gang_class", [agang.FakeGang, agang.ProcessGroupGang, FakeWorldGang])
def test_every_gang_implements_the_interface(gang_class: type[agang.Gang]) -> None:
    assert issubclass(gang_class, agang.Gang)
    assert not inspect.isabstract(gang_class)


def test_init_is_async_and_init_sync_is_not() -> None:
    assert inspect.iscoroutinefunction(agang.init)
    assert not inspect.iscoroutinefunction(agang.init_sync)
    assert inspect.signature(agang.init).parameters.keys() == (
        inspect.signature(agang.init_sync).parameters.keys()
    )


def test_reduce_ops() -> None:
    assert [op.name for op in agang.ReduceOp] == ["SUM", "MEAN", "PRODUCT", "MIN", "MAX"]


def test_handle_is_awaitable() -> None:
    assert inspect.isawaitable(agang.FakeGang().barrier())
