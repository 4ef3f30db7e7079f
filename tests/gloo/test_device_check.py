"""bench/device_check.py on a machine without a GPU: every step that needs one is skipped
with the reason, the others run, and one JSON file says so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gloo

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "device_check.py"


def _check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the steps run")
def test_without_a_gpu_the_gpu_steps_are_skipped_with_why_and_the_rest_run(
    tmp_path: Path,
) -> None:
    out = tmp_path / "check.json"
    done = _check(
        "--out",
        str(out),
        "--only",
        "environment",
        "bench_nccl",
        "test_cuda",
        "multi_process_nccl",
        "completion_mechanisms",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["gpu"] is None
    steps = report["steps"]
    assert list(steps) == [
        "environment",
        "bench_nccl",
        "test_cuda",
        "multi_process_nccl",
        "completion_mechanisms",
    ]
    no_gpu = {"skipped": "no CUDA GPU here (torch.cuda.is_available() is False)"}
    assert steps["bench_nccl"] == no_gpu
    assert steps["completion_mechanisms"] == no_gpu
    assert steps["multi_process_nccl"]["status"] == 0, steps["multi_process_nccl"]
    assert "needs a CUDA GPU" in steps["multi_process_nccl"]["output_tail"]
    assert steps["environment"]["torch"] == torch.__version__
    assert steps["environment"]["imports"]["anyio"] is True
    assert steps["test_cuda"]["status"] == 0, steps["test_cuda"]
    assert "skipped" in steps["test_cuda"]["output_tail"]  # its tests need a GPU
    assert "missing" not in report
    assert f"Wrote {out}" in done.stdout


def test_a_wheels_folder_that_is_not_one_is_refused_by_name(tmp_path: Path) -> None:
    done = _check("--wheels", str(tmp_path / "nowhere"), "--only", "environment")
    assert done.returncode == 2
    assert "--wheels must be a folder" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine it measures")
def test_the_mechanisms_bench_says_it_needs_a_gpu_and_writes_why(tmp_path: Path) -> None:
    out = tmp_path / "mechanisms.json"
    script = SCRIPT.parent / "nccl_mechanisms.py"
    done = subprocess.run(
        [sys.executable, str(script), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text()) == {
        "skipped": "needs a CUDA GPU (torch.cuda.is_available() is False)"
    }
