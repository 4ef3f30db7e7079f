"""``agang store`` refuses to listen on every interface unless asked, and refuses a
``--host`` that is no host name at all as a usage error: in process, with no store
started (one that would serve is stopped before it does).

Its serving, its signals and the flag's path (a store on every interface, with its
warning) start processes, and are in ``tests/gloo/test_store_command.py``.
"""

from __future__ import annotations

import socket
import subprocess
import sys
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


# Hosts that are no host name at all, each with how its message shows it: each used to
# end in a traceback ('' in a ValueError, the others in the resolver's UnicodeError) or,
# too long, in a message that printed all of it.
NO_HOST_NAMES = [
    ("", "is empty instead"),
    (" ", "is ' ' instead"),
    ("\t", "is '\\t' instead"),
    ("local host", "is 'local host' instead"),
    ("127.0.0.1\n", "is '127.0.0.1\\n' instead"),
    ("a\x00b", "is 'a\\x00b' instead"),
    ("\udcff", "is '\\udcff' instead"),  # a byte of argv that is not UTF-8
    ("a..b", "is 'a..b' instead"),
    (".", "is '.' instead"),
    ("a" * 64, f"is {'a' * 40!r}... (64 characters) instead"),
    ("a" * 300, f"is {'a' * 40!r}... (300 characters) instead"),
    ("x" * 63 + ("." + "x" * 63) * 4, f"is {'x' * 40!r}... (319 characters) instead"),
]


@pytest.mark.parametrize(("host", "shown"), NO_HOST_NAMES)
def test_a_host_that_is_no_host_name_is_a_one_line_usage_error(
    host: str, shown: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        __main__.main(["store", "--host", host, "--port", "0"])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("agang store: error: --host must be an address or host name"), error
    assert shown in error, error
    assert error.count("\n") == 1, error
    assert error.endswith("\n"), error
    assert len(error) < 300, error


@pytest.mark.parametrize(("host", "shown"), NO_HOST_NAMES)
def test_serve_store_refuses_a_host_that_is_no_host_name(host: str, shown: str) -> None:
    with pytest.raises(StoreUsageError) as refused:
        serve_store(host, 0)
    assert str(refused.value).startswith("--host must be"), refused.value
    assert shown in str(refused.value)


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "a" * 63 + ".invalid"])
def test_a_host_name_passes_the_check(host: str) -> None:
    store.check_host(host)  # refuses nothing: whether it resolves is binding's to say


def test_a_host_that_is_not_a_str_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="`host` must be a str, but is None instead"):
        serve_store(None, 0)  # type: ignore[arg-type]


@pytest.mark.slow  # runs the command in a process of its own
def test_the_command_with_an_empty_host_prints_no_traceback() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "agang", "store", "--host", "", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stderr == (
        "agang store: error: --host must be an address or host name of this machine, but "
        "is empty instead.\n"
    )
    assert result.stdout == ""
