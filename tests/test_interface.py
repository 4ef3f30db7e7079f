"""The ranks' network interface and the store's listening address (many hosts, 3 and 4).

The interface choice is a pure function of the interface table and the route, tested
with plain data; the store is hosted for real on 127.0.0.1 and reached (or not) through
another loopback address, 127.0.0.2, which a socket bound to 127.0.0.1 does not accept.
The namespace tests of ``tests/test_many_hosts.py`` run the same code across "hosts".
"""

from __future__ import annotations

import errno
import socket

import pytest

from agang._setup.env import WorldInfo
from agang._setup.interface import apply_interface, choose_interface
from agang._setup.rendezvous import _host, listen_on
from agang._setup.retry import is_address_in_use

TABLE = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.0.0.5"], "ib0": ["192.168.7.5"]}


def _route(table: dict[str, str]):  # type: ignore[no-untyped-def]
    return lambda host: table.get(host)


def test_the_interface_that_reaches_master_addr_is_chosen() -> None:
    routes = {"10.0.0.1": "10.0.0.5", "10.0.0.5": "10.0.0.5", "node0": "192.168.7.5"}
    for master, expected in [("10.0.0.1", "eth0"), ("10.0.0.5", "eth0"), ("node0", "ib0")]:
        choice = choose_interface(master, {}, addresses=lambda: TABLE, route=_route(routes))
        assert choice.ifname == expected, choice
        assert choice.candidates == ("eth0", "ib0")
    named = choose_interface(
        "10.0.0.1", {"AGANG_SOCKET_IFNAME": "ib0"}, addresses=lambda: TABLE, route=_route(routes)
    )
    assert (named.ifname, named.why) == ("ib0", "named by AGANG_SOCKET_IFNAME")


def test_no_choice_where_nothing_routes_or_holds_the_source() -> None:
    unroutable = choose_interface("x", {}, addresses=lambda: TABLE, route=lambda host: None)
    assert unroutable.ifname is None
    assert "no route" in unroutable.why
    foreign = choose_interface("x", {}, addresses=lambda: TABLE, route=lambda host: "10.9.9.9")
    assert foreign.ifname is None
    assert "no interface holds 10.9.9.9" in foreign.why


def test_apply_sets_only_what_the_user_left_unset(caplog: pytest.LogCaptureFixture) -> None:
    environ = {"GLOO_SOCKET_IFNAME": "eth7"}
    assert apply_interface("127.0.0.1", environ, nccl=False) == {}
    assert environ == {"GLOO_SOCKET_IFNAME": "eth7"}
    environ = {"NCCL_SOCKET_IFNAME": "ib0"}
    assert apply_interface("127.0.0.1", environ, nccl=True) == {"GLOO_SOCKET_IFNAME": "lo"}
    environ = {}
    with caplog.at_level("WARNING", logger="agang"):
        assert apply_interface("no-such-host.invalid", environ, nccl=True) == {}
    assert environ == {}
    assert "cannot tell which network interface" in caplog.text


def _reachable(address: str, port: int) -> bool:
    with socket.socket() as client:
        client.settimeout(2.0)
        try:
            client.connect((address, port))
        except OSError:
            return False
        return True


def test_the_store_listens_on_master_addr_only() -> None:
    world = WorldInfo(rank=0, world_size=2, local_rank=0, master_addr="127.0.0.1", master_port=0)
    store = _host(world, 0, 10.0)
    try:
        assert _reachable("127.0.0.1", store.port)
        assert not _reachable("127.0.0.2", store.port)  # before: every interface
        store.set("key", "value")
        assert store.get("key") == b"value"
    finally:
        del store


def test_a_taken_port_is_address_in_use_and_a_foreign_address_is_no_listener() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError, match="in use") as caught:
            listen_on("127.0.0.1", taken.getsockname()[1])
        assert caught.value.errno == errno.EADDRINUSE
        assert is_address_in_use(caught.value)
    assert listen_on("192.0.2.123", 0) is None  # TEST-NET-1: not this host's


def test_a_loopback_master_addr_in_a_job_across_hosts_fails_at_once() -> None:
    import time

    import agang
    from agang._setup.interface import check_master_reachable

    check_master_reachable("127.0.0.1", 2, 2)  # one host: fine
    check_master_reachable("127.0.0.1", 4, None)  # unknown: left to the store
    env = {
        "RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "localhost",
        "MASTER_PORT": "29999",
    }
    started = time.monotonic()
    with pytest.raises(agang.GangInitError, match="--local-addr"):
        agang.init_sync(env=env, timeout=30)
    assert time.monotonic() - started < 5.0  # before: the whole 30 s deadline
