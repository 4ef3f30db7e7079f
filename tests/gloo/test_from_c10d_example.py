"""examples/from_c10d.py as docs/guides/from-torch-distributed.md runs it: every c10d call
of the page's table and its agang form, on 3 real Gloo ranks, on the same inputs, agree."""

from __future__ import annotations

from pathlib import Path

import pytest
from scriptrun import run_script

pytestmark = pytest.mark.gloo

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "from_c10d.py"
# The calls compared, some on one rank only (reduce, gather: the destination; the
# sub-gang's: its members), all named in the page's table.
CALLS = (
    "all_reduce", "all_reduce MEAN", "all_reduce(async_op=True)", "all_gather_single",
    "all_gather", "reduce_scatter_single", "broadcast", "all_to_all_single (uneven)", "reduce",
    "gather", "scatter", "send / recv", "batch_isend_irecv", "broadcast_object_list",
    "all_gather_object", "all_reduce(group=...)", "all_reduce(timeout=30)",
)  # fmt: skip


def test_every_c10d_call_and_its_agang_form_agree() -> None:
    result = run_script(SCRIPT, [], timeout=110)

    assert result.returncode == 0, result.stdout + result.stderr
    [line] = [line for line in result.stdout.splitlines() if line.startswith("agang and c10d")]
    agreed = line.split(": ", 1)[1].split(", ")
    assert set(CALLS) <= set(agreed), (CALLS, line)
    assert "Warning" not in result.stderr, result.stderr  # no deprecated c10d name used
