"""The one-command device check: what a machine with one GPU runs once, end to end.

    python bench/device_check.py [--out FILE] [--wheels DIR] [--only STEP ...]

Runs each step below in a process of its own, under a time limit, and writes one JSON
file (``bench/out/device_check.json`` unless ``--out``) with each step's command, exit
status, seconds, the tail of its output, and, for a step that cannot run here, why it
was skipped. Steps that need a CUDA GPU are skipped with that reason on a machine
without one, so the whole check also runs (and is tested) on a CPU.

Steps:
1. ``environment``: Python, torch, CUDA and NCCL versions, the GPU's name, and which
   of agang's requirements import (tenacity and trio are often missing on a device
   image: ``--wheels DIR`` installs them first from wheels brought along, with
   ``pip --no-index --find-links DIR``, never from the network).
2. ``bench_nccl``: ``bench/bench_nccl.py``, an awaited op against raw c10d plus a
   synchronize, 4 B to 64 MiB, both completion modes (GPU only).
3. ``selfcheck``: ``agang selfcheck``, on real NCCL with a GPU, on the simulation
   without one.
4. ``test_cuda``: ``pytest tests/gloo/test_cuda.py`` (its tests skip without a GPU).
5. ``multi_process_nccl``: ``pytest tests/gloo/test_nccl_processes_cuda.py``, the
   multi-process NCCL tests (a killed rank, an elastic reform and a joiner, weights with
   a killed server) on real NCCL, two or three ranks on the one GPU, each claiming a host
   of its own (``NCCL_HOSTID``): for correctness only (GPU only; CI runs their cases on
   the simulated NCCL).
6. ``completion_mechanisms``: ``bench/nccl_mechanisms.py``, each mechanism of agang's
   NCCL completion path timed alone against the raw baseline (GPU only).

The limits add up to 450 s, well under the 8 minutes a check may take.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "out" / "device_check.json"
#: Each step's limit, seconds: together well under the 8 minutes a check may take.
LIMITS = {
    "environment": 45.0,
    "bench_nccl": 120.0,
    "selfcheck": 60.0,
    "test_cuda": 60.0,
    "multi_process_nccl": 120.0,
    "completion_mechanisms": 45.0,
}
STEPS = tuple(LIMITS)
_TAIL = 4000
_REQUIREMENTS = ("torch", "anyio", "uvloop", "tenacity", "trio", "pytest")


def _has_gpu() -> tuple[bool, str]:
    try:
        import torch
    except ImportError as error:
        return False, f"torch does not import: {error}"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU here (torch.cuda.is_available() is False)"
    return True, torch.cuda.get_device_name(0)


def _run(command: Sequence[str], limit: float) -> dict[str, Any]:
    started = time.monotonic()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    try:
        done = subprocess.run(
            list(command), cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit
        )
        status: int | None = done.returncode
        output = done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        status = None
        output = f"{_text(expired.stdout)}{_text(expired.stderr)}\n(ended at its {limit:g} s limit)"
    return {
        "command": list(command),
        "status": status,
        "seconds": round(time.monotonic() - started, 2),
        "output_tail": output[-_TAIL:],
    }


def _text(data: str | bytes | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def _environment(wheels: Path | None) -> dict[str, Any]:
    report: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    if wheels is not None:
        missing = [name for name in ("tenacity", "trio") if not _imports(name)]
        if missing:
            install = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links",
                       str(wheels), *missing]  # fmt: skip
            report["install"] = _run(install, LIMITS["environment"])
    report["imports"] = {name: _imports(name) for name in _REQUIREMENTS}
    try:
        import torch

        report["torch"] = torch.__version__
        report["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            report["gpu"] = torch.cuda.get_device_name(0)
            version = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
            report["nccl"] = ".".join(str(part) for part in version)
    except ImportError:
        pass
    return report


def _imports(name: str) -> bool:
    probe = [sys.executable, "-c", f"import {name}"]
    return subprocess.run(probe, capture_output=True, timeout=60).returncode == 0


def _step(name: str, gpu: bool, why_not: str) -> dict[str, Any]:
    python = sys.executable
    if name == "bench_nccl":
        if not gpu:
            return {"skipped": why_not}
        return _run([python, "bench/bench_nccl.py"], LIMITS[name])
    if name == "selfcheck":
        return _run([python, "-m", "agang", "selfcheck"], LIMITS[name])
    if name in ("test_cuda", "multi_process_nccl"):
        # The repo's addopts ask for pytest-xdist, which a device image may lack.
        test = "test_cuda.py" if name == "test_cuda" else "test_nccl_processes_cuda.py"
        command = [python, "-m", "pytest", "-q", "-rs", "-o", "addopts=", "-p",
                   "no:cacheprovider", f"tests/gloo/{test}"]  # fmt: skip
        return _run(command, LIMITS[name])
    if name == "completion_mechanisms":
        if not gpu:
            return {"skipped": why_not}
        mechanisms = ROOT / "bench" / "out" / "nccl_mechanisms.json"
        result = _run([python, "bench/nccl_mechanisms.py", "--json", str(mechanisms)], LIMITS[name])
        if mechanisms.exists():
            result["mechanisms"] = json.loads(mechanisms.read_text()).get("mechanisms")
        return result
    raise ValueError(f"`step` must be one of {STEPS}, but is {name!r} instead.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON file to write")
    parser.add_argument(
        "--wheels", type=Path, default=None, help="a folder of wheels for what does not import"
    )
    parser.add_argument(
        "--only", nargs="+", choices=STEPS, default=None, help="run these steps alone"
    )
    args = parser.parse_args(argv)
    if args.wheels is not None and not args.wheels.is_dir():
        parser.error(f"--wheels must be a folder, but {args.wheels} is not one")
    started = time.monotonic()
    gpu, about = _has_gpu()
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "gpu": about if gpu else None,
        "steps": {},
    }
    for name in args.only or STEPS:
        print(f"== {name}", flush=True)
        step_started = time.monotonic()
        result = _environment(args.wheels) if name == "environment" else _step(name, gpu, about)
        report["steps"][name] = result
        status = (
            "skipped: " + result["skipped"]
            if "skipped" in result
            else (f"status {result.get('status', 0)}")
        )
        print(f"   {status} ({time.monotonic() - step_started:.1f} s)", flush=True)
    report["seconds"] = round(time.monotonic() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    failed = [
        name
        for name, result in report["steps"].items()
        if "skipped" not in result and result.get("status", 0) != 0
    ]
    print(f"Wrote {args.out} in {report['seconds']:g} s; failed: {', '.join(failed) or 'none'}.")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
