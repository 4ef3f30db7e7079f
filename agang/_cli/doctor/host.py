"""``agang doctor``'s backend checks: what this host's torch build offers agang."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from agang._backends.c10d.log import DEBUG_VARIABLE, c10d_output_wanted
from agang._cli.doctor.findings import Finding, Status
from agang._setup.process import KEEP_NCCL_SETTINGS, NCCL_SETTINGS, launcher_default


@dataclass(frozen=True)
class HostFacts:
    """What this host's torch build and hardware offer.

    Attributes:
        torch_version: ``torch.__version__``.
        distributed_available: ``torch.distributed.is_available()``.
        gloo_available: ``torch.distributed.is_gloo_available()``.
        nccl_available: ``torch.distributed.is_nccl_available()``.
        cuda_available: ``torch.cuda.is_available()``.
        cuda_device_count: ``torch.cuda.device_count()``, 0 without CUDA.
        cuda_version: ``torch.version.cuda``; None for a CPU-only build.
        nccl_version: ``torch.cuda.nccl.version()`` as "2.21.5"; None where unknown.
        num_cpus: The CPUs this process may run on; None where unknown.
    """

    torch_version: str
    distributed_available: bool
    gloo_available: bool
    nccl_available: bool
    cuda_available: bool
    cuda_device_count: int
    cuda_version: str | None
    nccl_version: str | None
    num_cpus: int | None


def probe_host_facts() -> HostFacts:
    """Reads ``HostFacts`` from the installed torch; a failing query reads as absent."""
    import torch
    import torch.distributed as dist

    distributed = dist.is_available()
    cuda = torch.cuda.is_available()
    nccl_version: str | None = None
    if distributed and cuda:
        try:
            version: object = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
        except (AttributeError, RuntimeError, OSError):  # a build without NCCL lacks it
            version = None
        if isinstance(version, tuple):
            nccl_version = ".".join(str(part) for part in version)
        elif version is not None:
            nccl_version = str(version)
    return HostFacts(
        torch_version=torch.__version__,
        distributed_available=distributed,
        gloo_available=distributed and dist.is_gloo_available(),
        nccl_available=distributed and dist.is_nccl_available(),
        cuda_available=cuda,
        cuda_device_count=torch.cuda.device_count() if cuda else 0,
        cuda_version=torch.version.cuda,
        nccl_version=nccl_version,
        num_cpus=_num_cpus(),
    )


def _num_cpus() -> int | None:
    # The CPUs this process may run on (cgroup- and taskset-aware), not the machine's.
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count()


_ASYNC_ERROR_HANDLING = {
    "0": (Status.OK, "no watchdog teardown; agang aborts the communicator itself on a timeout"),
    "1": (Status.WARN, "tear down: on an NCCL error or timeout the process is killed"),
    "2": (Status.OK, "clean up only: the communicator is aborted and the process survives"),
    "3": (Status.WARN, "tear down without clean-up: on an NCCL error the process is killed"),
}


def backend_findings(env: Mapping[str, str], facts: HostFacts) -> list[Finding]:
    """The torch build, its c10d backends, CUDA, and NCCL's error handling.

    Args:
        env: The environment (for ``TORCH_NCCL_ASYNC_ERROR_HANDLING``).
        facts: This host's torch build and hardware.

    Returns:
        The findings, in that order.
    """
    cuda = f"CUDA {facts.cuda_version}" if facts.cuda_version else "CPU-only build"
    findings = [Finding("torch", Status.OK, f"torch {facts.torch_version} ({cuda}).")]
    if not facts.distributed_available:
        findings.append(
            Finding(
                "torch.distributed",
                Status.PROBLEM,
                "`torch.distributed.is_available()` must be True, but is False instead.",
                fix="Install a torch build with distributed support (the builds on pypi.org "
                "and download.pytorch.org have it).",
            )
        )
        return findings
    if facts.gloo_available:
        findings.append(Finding("gloo", Status.OK, "Gloo is available (CPU tensors)."))
    else:
        findings.append(
            Finding(
                "gloo",
                Status.PROBLEM,
                "Gloo is not available: agang has no backend for CPU tensors.",
                fix="Install a torch build with Gloo (every official build has it).",
            )
        )
    if facts.cuda_available:
        findings.append(
            Finding("cuda", Status.OK, f"CUDA is available: {facts.cuda_device_count} device(s).")
        )
    else:
        findings.append(Finding("cuda", Status.OK, "CUDA is not available: agang uses Gloo."))
    if facts.nccl_available:
        version = f" (NCCL {facts.nccl_version})" if facts.nccl_version else ""
        findings.append(Finding("nccl", Status.OK, f"NCCL is available{version}."))
    elif facts.cuda_available:
        findings.append(
            Finding(
                "nccl",
                Status.PROBLEM,
                "CUDA is available but NCCL is not: agang has no backend for CUDA tensors.",
                fix="Install a CUDA build of torch with NCCL (the official Linux builds).",
            )
        )
    else:
        findings.append(Finding("nccl", Status.OK, "NCCL is not available (no CUDA)."))
    findings.append(_async_error_handling_finding(env, facts))
    findings.extend(_monitoring_findings(env, facts))
    findings.append(c10d_log_finding(env))
    return findings


def c10d_log_finding(env: Mapping[str, str]) -> Finding:
    """What ``agang.init`` does with c10d's C++ log while it opens the store (see
    ``agang._backends.c10d.log``): quiet, or left as the user's variable asks.

    Raises:
        TypeError: ``env`` is not a mapping.
    """
    wanted = c10d_output_wanted(env)
    if wanted is None:
        return Finding(
            "c10d log",
            Status.OK,
            f"quiet while agang.init opens the store (one INFO line per retry instead of "
            f"c10d's C++ traces); {DEBUG_VARIABLE}=1 shows it.",
        )
    return Finding(
        "c10d log",
        Status.OK,
        f"{wanted} is set: agang.init leaves c10d's log as torch makes it.",
    )


def _async_error_handling_finding(env: Mapping[str, str], facts: HostFacts) -> Finding:
    name = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    value = env.get(name)
    used = facts.nccl_available and facts.cuda_available
    if value is not None and value not in _ASYNC_ERROR_HANDLING:
        return Finding(
            name,
            Status.PROBLEM if used else Status.WARN,
            f"`{name}` must be 0, 1, 2 or 3, but is {value!r} instead.",
            fix=f"Set {name}=2 (abort the communicator, keep the process) or unset it.",
        )
    launcher = launcher_default(env, name)
    if launcher is not None:
        agangs, why = NCCL_SETTINGS[name]
        return Finding(
            name,
            Status.OK,
            f"{value}, {launcher}'s default for its workers: agang.init sets {agangs} "
            f"({why}; {KEEP_NCCL_SETTINGS}=1 keeps {value}).",
        )
    status, meaning = _ASYNC_ERROR_HANDLING["3" if value is None else value]
    shown = "unset, so torch's default 3" if value is None else value
    if not used:
        return Finding(name, Status.OK, f"{shown}, {meaning}; not used here, without NCCL.")
    if status is Status.OK:
        return Finding(name, status, f"{shown}, {meaning}.")
    return Finding(
        name,
        status,
        f"{shown}, {meaning}, instead of agang raising an error the program can handle.",
        fix=f"Set {name}=2 if the program must survive a failed collective.",
    )


def _monitoring_findings(env: Mapping[str, str], facts: HostFacts) -> list[Finding]:
    """The NCCL settings besides error handling that ``agang.init`` makes (the table
    ``agang._setup.process.NCCL_SETTINGS``): whether the user's values keep a c10d-side
    timeout from killing the process."""
    used = facts.nccl_available and facts.cuda_available
    findings = []
    for name, (agangs, why) in NCCL_SETTINGS.items():
        if name == "TORCH_NCCL_ASYNC_ERROR_HANDLING":
            continue  # its own finding above
        value = env.get(name)
        if value is None:
            shown = f"unset: agang.init sets {agangs} ({why})"
            findings.append(Finding(name, Status.OK, f"{shown}." if used else f"{shown}; no NCCL."))
        elif value == agangs or not used:
            findings.append(Finding(name, Status.OK, f"{value}."))
        else:
            findings.append(
                Finding(
                    name,
                    Status.WARN,
                    f"{value}: after a c10d-side timeout or error NCCL's heartbeat monitor may "
                    f"kill every rank, instead of agang raising an error the program can handle.",
                    fix=f"Unset {name} (agang.init sets {agangs}) or set it to {agangs}.",
                )
            )
    return findings
