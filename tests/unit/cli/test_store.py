"""``agang store`` refuses to listen on every interface unless asked: in process, with no
store started (one that would serve is stopped before it does).

Its serving, its signals and the flag's path (a store on every interface, with its
warning) start processes, and are in ``tests/gloo/test_store_command.py``.
"""

from __future__ import annotations

import socket
from typing import Any

import pytest

from agang import __main__
from agang._cli import store
from agang._cli.store import StoreUsageError, serve_store

# Each means every interface: IPv4's and IPv6's unspecified address, and other
# spellings that resolve to them.
EVERY_INTERFACE = ["0.0.0.0", "::", "0", "0:0::0"]


@pytest.fixture(autouse=True)
def never_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host that was bound is closed at once instead of served: a test that fails
    leaves no store behind, on any interface."""

    def refuse(listener: socket.socket, out: Any) -> int:
        address = listener.getsockname()[0]
        listener.close()
        raise AssertionError(f"the store was about to serve on {address}")

    monkeypatch.setattr(store, "_serve", refuse)


@pytest.mark.parametrize("host", EVERY_INTERFACE)
def test_a_host_meaning_every_interface_is_a_usage_error_naming_the_flag(
    host: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        __main__.main(["store", "--host", host, "--port", "0"])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert f"--host {host} would listen on every interface" in error
    assert "no authentication" in error
    assert "join or disrupt the job" in error
    assert "--allow-all-interfaces" in error
    assert "agang store listening" not in error


@pytest.mark.parametrize("host", EVERY_INTERFACE)
def test_serve_store_refuses_every_interface_unless_allowed(host: str) -> None:
    with pytest.raises(StoreUsageError, match="--allow-all-interfaces"):
        serve_store(host, 0)


def test_one_address_needs_no_flag() -> None:
    # Bound, then (the fixture) closed before it is served.
    with pytest.raises(AssertionError, match=r"about to serve on 127\.0\.0\.1"):
        serve_store("127.0.0.1", 0)


@pytest.mark.parametrize("value", [1, "yes", None])
def test_allow_all_interfaces_must_be_a_bool(value: Any) -> None:
    with pytest.raises(ValueError, match="`allow_all_interfaces` must be a bool"):
        serve_store("127.0.0.1", 0, allow_all_interfaces=value)
