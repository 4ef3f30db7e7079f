"""c10d's C++ log while a rank waits for a late store host: quiet by default, and back
with ``AGANG_DEBUG=1`` or torch's own variables (``agang._backends.c10d.log``).

The end-to-end tests run two real processes on Gloo over 127.0.0.1: rank 1 starts, and
rank 0, the store's host, only once rank 1 has failed at least one attempt.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from netutil import free_port, rank_env

from agang._backends.c10d import log as c10d_log
from agang._cli.doctor.host import c10d_log_finding
from agang._errors import one_line

REPO = Path(__file__).resolve().parents[2]
# A C++ frame as c10d prints it ("frame #3: ..."), or symbolized ("#3 c10::Error ...").
TRACE_LINE = re.compile(r"^(frame )?#\d+", re.MULTILINE)
RETRY_LINE = "retrying in"
# Started later than this, rank 0 is late in any case (the retry line may never come).
HOST_DELAY_CAP = 12.0

WORKER = """
import logging, sys
import agang
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
gang = agang.init_sync(backend="gloo", timeout=60)
gang.close_sync()
print("up", flush=True)
"""


def _clean_env(extra: dict[str, str]) -> dict[str, str]:
    """This environment without the variables that choose c10d's log, plus ``extra``."""
    chosen = {c10d_log.DEBUG_VARIABLE, *c10d_log.TORCH_LOG_VARIABLES}
    env = {k: v for k, v in os.environ.items() if k not in chosen}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests" / "support")])
    return {**env, **extra}


def _late_host_run(tmp_path: Path, extra: dict[str, str]) -> str:
    """Runs rank 1, then rank 0 (the store host) once rank 1 said it retries (at most
    HOST_DELAY_CAP s later); returns rank 1's stderr after both finished well."""
    port = free_port()
    err_path = tmp_path / "rank1.err"
    procs = []
    with err_path.open("w") as err:
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", WORKER],
                env={**_clean_env(extra), **rank_env(1, port, agent_store=False)},
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        )
        started = time.monotonic()
        while (
            RETRY_LINE not in err_path.read_text() and time.monotonic() - started < HOST_DELAY_CAP
        ):
            assert procs[0].poll() is None, err_path.read_text()
            time.sleep(0.1)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", WORKER],
                env={**_clean_env(extra), **rank_env(0, port, agent_store=False)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
        try:
            outputs = [proc.communicate(timeout=90) for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
    text = err_path.read_text()
    assert [proc.returncode for proc in procs] == [0, 0], (text, outputs[1][1])
    assert all("up" in out for out, _ in outputs), (text, outputs)
    return text


def test_a_late_store_host_leaves_no_cpp_traces_only_agangs_retry_lines(
    tmp_path: Path,
) -> None:
    text = _late_host_run(tmp_path, {})
    assert TRACE_LINE.findall(text) == [], text
    assert "TCPStore.cpp" not in text, text
    assert "socket.cpp" not in text, text
    retries = [line for line in text.splitlines() if RETRY_LINE in line]
    assert retries, text
    assert all("attempt" in line and "at the store 127.0.0.1:" in line for line in retries)
    assert "c10d's log is quiet while this rank opens the store" in text


@pytest.mark.parametrize(
    "extra",
    [{"AGANG_DEBUG": "1"}, {"TORCH_CPP_LOG_LEVEL": "INFO"}],
    ids=["AGANG_DEBUG", "TORCH_CPP_LOG_LEVEL"],
)
def test_c10d_traces_come_back_when_asked_for(tmp_path: Path, extra: dict[str, str]) -> None:
    text = _late_host_run(tmp_path, extra)
    assert TRACE_LINE.findall(text), text
    assert "TCPStore.cpp" in text, text
    name = next(iter(extra))
    assert f"{name} is set: c10d's own log output is left as torch makes it" in text


def test_a_quiet_section_raises_the_threshold_and_puts_it_back() -> None:
    if not c10d_log.can_quiet():
        pytest.skip("this torch build does not expose c10's log threshold")
    flag = c10d_log._log_level_flag()
    assert flag is not None
    before = flag.value
    with c10d_log.quiet_c10d({}):
        assert flag.value == 3
        with c10d_log.quiet_c10d({}):  # nested: the outer one restores
            assert flag.value == 3
        assert flag.value == 3
    assert flag.value == before
    with c10d_log.quiet_c10d({"AGANG_DEBUG": "1"}):
        assert flag.value == before


def test_which_variables_ask_for_c10ds_output() -> None:
    wanted = c10d_log.c10d_output_wanted
    assert wanted({}) is None
    assert wanted({"AGANG_DEBUG": "0"}) is None
    assert wanted({"AGANG_DEBUG": ""}) is None
    assert wanted({"AGANG_DEBUG": "1"}) == "AGANG_DEBUG"
    assert wanted({"TORCH_CPP_LOG_LEVEL": "WARNING"}) == "TORCH_CPP_LOG_LEVEL"
    assert wanted({"TORCH_SHOW_CPP_STACKTRACES": "1"}) == "TORCH_SHOW_CPP_STACKTRACES"
    assert wanted({"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}) == "TORCH_DISTRIBUTED_DEBUG"
    with pytest.raises(TypeError, match="`env` must be a mapping"):
        wanted("AGANG_DEBUG=1")  # type: ignore[arg-type]


def test_doctor_says_whether_set_up_is_quiet() -> None:
    assert "AGANG_DEBUG=1 shows it" in c10d_log_finding({}).seen
    assert "TORCH_CPP_LOG_LEVEL is set" in c10d_log_finding({"TORCH_CPP_LOG_LEVEL": "0"}).seen


def test_one_line_keeps_the_first_line_only() -> None:
    error = RuntimeError("it failed\nException raised from x\nframe #0: y")
    assert one_line(error) == "it failed"
    assert one_line(RuntimeError("x" * 300), limit=10) == "xxxxxxx..."
    assert one_line(RuntimeError("")) == "RuntimeError"
    with pytest.raises(ValueError, match="`limit`"):
        one_line(error, limit=0)
