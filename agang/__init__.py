"""agang: awaitable, deadline-guarded collectives for PyTorch.

Example:
    >>> import agang, torch
    >>> gang = await agang.init()
    >>> total = await gang.all_reduce(torch.ones(1))
"""

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
