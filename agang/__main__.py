"""The ``agang`` command (or ``python -m agang``): ``doctor``, ``selfcheck`` and ``store``.

Each command's modules load inside its branch of ``main``, so that ``agang --help``
and ``agang --version`` load no torch (``agang/__init__.py`` is lazy too).

Exit status: 0 when the doctor found no problem (warnings allowed), every self-check
passed, or the store was stopped by SIGTERM or SIGINT; 1 otherwise; 2 on a usage error.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence


def _version() -> str:
    from agang import __version__

    return __version__


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, but is {text!r} instead") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be positive and finite, but is {text} instead")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, but is {text!r} instead") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], but is {value} instead")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agang", description="agang's command-line tools.")
    parser.add_argument("--version", action="version", version=f"agang {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    doctor = commands.add_parser(
        "doctor",
        help="check this process's launcher variables, backends and rendezvous network",
        description="Checks what agang.init() would make of this process's environment: "
        "the launcher's variables, torch's backends, and whether MASTER_ADDR:MASTER_PORT "
        "can be bound (rank 0) or reached (other ranks). Run it the way the job runs, e.g. "
        "`torchrun --nproc-per-node=4 -m agang doctor`: each node's local rank 0 prints "
        "the report, the other ranks only problems of their own.",
    )
    doctor.add_argument("--json", action="store_true", help="print the findings as JSON")
    doctor.add_argument(
        "--timeout",
        type=_seconds,
        default=1.0,
        metavar="SECONDS",
        help="bound on each network call (default: 1)",
    )
    selfcheck = commands.add_parser(
        "selfcheck",
        help="check agang's NCCL paths on this machine's GPUs (or on the simulation)",
        description="Runs agang's NCCL paths and prints a PASS/FAIL table with figures: "
        "completion, barrier, timeout then abort, close, stream-ordered mode, separate "
        "gangs, GradientSync against DDP, device binding, private streams. On a GPU "
        "machine it uses real NCCL (one GPU, or `torchrun --nproc-per-node N -m agang "
        "selfcheck`); without a GPU it runs the same checks on agang.testing.SimulatedNccl.",
    )
    selfcheck.add_argument(
        "--simulate", action="store_true", help="use the simulation even where a GPU is present"
    )
    selfcheck.add_argument(
        "--verbose", action="store_true", help="show agang's log (the checks break gangs)"
    )
    store = commands.add_parser(
        "store",
        help="serve a rendezvous store that outlives every rank",
        description="Serves c10d's TCPStore on one address of this machine until SIGTERM "
        "or Ctrl-C. Its first line is `agang store listening on ADDR:PORT`; joins and "
        "leaves are logged to stderr. Ranks join it with MASTER_ADDR and MASTER_PORT naming "
        "it and TORCHELASTIC_USE_AGENT_STORE=1. It has no authentication: whoever reaches "
        "the port can read and write every key, so bind it to a private network address; "
        "a --host meaning every interface (0.0.0.0, ::) is refused without "
        "--allow-all-interfaces.",
    )
    store.add_argument(
        "--host",
        default="127.0.0.1",
        help="the one address to listen on, an address of this machine (default: 127.0.0.1)",
    )
    store.add_argument(
        "--port", type=_port, default=0, help="the port; 0 takes a free one (default: 0)"
    )
    store.add_argument("--quiet", action="store_true", help="do not log joins and leaves")
    store.add_argument(
        "--allow-all-interfaces",
        action="store_true",
        help="let --host be 0.0.0.0 or :: (every interface), refused otherwise: the store "
        "is unauthenticated, so anyone who reaches the port can join or disrupt the job",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``agang`` command.

    Args:
        argv: The arguments after the program name; None for ``sys.argv[1:]``.

    Returns:
        The exit status: 0 no problem (or the store stopped), 1 problems found (2, usage
        errors, exits: at parsing, or when the store cannot listen where it is told).

    Example:
        <!-- not-run: runs agang doctor's probes of this machine and its network -->
        ```python
        main(["doctor", "--json"])
        # 0
        ```
    """
    parser = _parser()
    arguments = parser.parse_args(argv)
    if arguments.command == "store":
        from agang._cli.store import StoreUsageError, serve_store

        try:
            return serve_store(
                arguments.host,
                arguments.port,
                quiet=arguments.quiet,
                allow_all_interfaces=arguments.allow_all_interfaces,
            )
        except StoreUsageError as error:
            parser.exit(2, f"agang store: error: {error}\n")
    if arguments.command == "selfcheck":
        from agang._cli.selfcheck.run import selfcheck  # imports torch.cuda paths only here

        return selfcheck(simulate=arguments.simulate, out=sys.stdout, verbose=arguments.verbose)
    from agang._cli.doctor.command import run_doctor  # torch loads for the doctor only

    return run_doctor(timeout=arguments.timeout, as_json=arguments.json, out=sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
