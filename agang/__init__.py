"""agang: awaitable, deadline-guarded collectives for PyTorch.

Example:
    <!-- not-run: agang.init joins the world a launcher (torchrun) set up -->
    ```python
    import agang, torch
    gang = await agang.init()
    total = await gang.all_reduce(torch.ones(1))
    ```

Importing agang is cheap: each public name's module (and torch with it) loads on the
name's first use (PEP 562's module ``__getattr__``), so ``agang --help`` and code that
only names agang's errors never load torch. Type checkers and IDEs read the imports
under ``TYPE_CHECKING``; ``_EXPORTS`` is the same table for the interpreter, and
``tests/unit/test_lazy_import.py`` keeps the two equal.
"""

import typing as _typing

if _typing.TYPE_CHECKING:
    from agang._backends.c10d.retry import RetryPolicy as RetryPolicy
    from agang._collective.fake_gang import FakeGang as FakeGang
    from agang._collective.process_group_gang import ProcessGroupGang as ProcessGroupGang
    from agang._errors import CollectiveError as CollectiveError
    from agang._errors import CollectiveMismatchError as CollectiveMismatchError
    from agang._errors import GangBrokenError as GangBrokenError
    from agang._errors import GangClosedError as GangClosedError
    from agang._errors import GangError as GangError
    from agang._errors import GangFullError as GangFullError
    from agang._errors import GangInheritedError as GangInheritedError
    from agang._errors import GangInitError as GangInitError
    from agang._errors import GangTimeoutError as GangTimeoutError
    from agang._errors import OpContext as OpContext
    from agang._errors import TensorBusyError as TensorBusyError
    from agang._gang import Gang as Gang
    from agang._gradient_sync import GradientSync as GradientSync
    from agang._gradient_sync import StepTimes as StepTimes
    from agang._handle import Coalesced as Coalesced
    from agang._handle import Handle as Handle
    from agang._membership.deaths import report_death as report_death
    from agang._membership.deaths import report_death_sync as report_death_sync
    from agang._parallel.gangs import Gangs as Gangs
    from agang._parallel.gangs import all_sum as all_sum
    from agang._parallel.gangs import broadcast_flag as broadcast_flag
    from agang._parallel.gangs import current_gangs as current_gangs
    from agang._parallel.layout import create_fsdp_gangs as create_fsdp_gangs
    from agang._parallel.layout import create_parallel_gangs as create_parallel_gangs
    from agang._policy import InFlightLimits as InFlightLimits
    from agang._reduce_op import ReduceOp as ReduceOp
    from agang._setup.elastic import Elastic as Elastic
    from agang._setup.elastic_gang import ElasticGang as ElasticGang
    from agang._setup.env import WorldInfo as WorldInfo
    from agang._setup.init import init as init
    from agang._setup.init import init_sync as init_sync
    from agang._statistics import GangStatistics as GangStatistics
    from agang._statistics import Quantiles as Quantiles
    from agang._weights.publisher import WeightPublisher as WeightPublisher
    from agang._weights.report import PushReport as PushReport
    from agang._weights.sharded import Sharded as Sharded
    from agang._weights.subscriber import WeightSubscriber as WeightSubscriber

# Public name -> the module that defines it: loaded on the name's first use.
_EXPORTS: dict[str, str] = {
    "RetryPolicy": "agang._backends.c10d.retry",
    "FakeGang": "agang._collective.fake_gang",
    "ProcessGroupGang": "agang._collective.process_group_gang",
    "CollectiveError": "agang._errors",
    "CollectiveMismatchError": "agang._errors",
    "GangBrokenError": "agang._errors",
    "GangClosedError": "agang._errors",
    "GangError": "agang._errors",
    "GangFullError": "agang._errors",
    "GangInheritedError": "agang._errors",
    "GangInitError": "agang._errors",
    "GangTimeoutError": "agang._errors",
    "OpContext": "agang._errors",
    "TensorBusyError": "agang._errors",
    "Gang": "agang._gang",
    "GradientSync": "agang._gradient_sync",
    "StepTimes": "agang._gradient_sync",
    "Coalesced": "agang._handle",
    "Handle": "agang._handle",
    "report_death": "agang._membership.deaths",
    "report_death_sync": "agang._membership.deaths",
    "Gangs": "agang._parallel.gangs",
    "all_sum": "agang._parallel.gangs",
    "broadcast_flag": "agang._parallel.gangs",
    "current_gangs": "agang._parallel.gangs",
    "create_fsdp_gangs": "agang._parallel.layout",
    "create_parallel_gangs": "agang._parallel.layout",
    "InFlightLimits": "agang._policy",
    "ReduceOp": "agang._reduce_op",
    "Elastic": "agang._setup.elastic",
    "ElasticGang": "agang._setup.elastic_gang",
    "WorldInfo": "agang._setup.env",
    "init": "agang._setup.init",
    "init_sync": "agang._setup.init",
    "GangStatistics": "agang._statistics",
    "Quantiles": "agang._statistics",
    "WeightPublisher": "agang._weights.publisher",
    "PushReport": "agang._weights.report",
    "Sharded": "agang._weights.sharded",
    "WeightSubscriber": "agang._weights.subscriber",
}

__version__ = "0.1.0"

__all__ = [
    # Making gangs
    "init",
    "init_sync",
    "WorldInfo",
    "RetryPolicy",
    # Gangs and handles
    "Gang",
    "ProcessGroupGang",
    "ElasticGang",
    "Elastic",
    "report_death",
    "report_death_sync",
    "FakeGang",
    "Handle",
    "Coalesced",
    "ReduceOp",
    "GangStatistics",
    "Quantiles",
    "InFlightLimits",
    # Data-parallel training
    "GradientSync",
    "StepTimes",
    # Parallel gangs
    "Gangs",
    "create_parallel_gangs",
    "create_fsdp_gangs",
    "current_gangs",
    "broadcast_flag",
    "all_sum",
    # Weights to a changing fleet
    "WeightPublisher",
    "WeightSubscriber",
    "PushReport",
    "Sharded",
    # Errors
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
]


def _load(name: str) -> object:
    """Module ``__getattr__``: imports the module of the public ``name`` and binds it here,
    so that each name is looked up through this once."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def _names() -> list[str]:
    """Module ``__dir__``: the names bound so far and every public one."""
    return sorted({*globals(), *__all__})


# Hidden from type checkers, which read the imports above: a typo such as ``agang.Gnag``
# stays an error for them instead of reading as an ``object`` from ``__getattr__``.
if not _typing.TYPE_CHECKING:
    __getattr__ = _load
    __dir__ = _names
