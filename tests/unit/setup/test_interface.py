"""The ranks' network interface and the store's listening address (many hosts, 3 and 4).

The interface choice is a pure function of the interface table and the route, tested
with plain data; the store is hosted for real on 127.0.0.1 and reached (or not) through
another loopback address, 127.0.0.2, which a socket bound to 127.0.0.1 does not accept.
The namespace tests of ``tests/gloo/test_many_hosts.py`` run the same code across "hosts".
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time
from typing import Any

import pytest
import torch.distributed as dist

from agang._backends.c10d.retry import is_address_in_use
from agang._setup.env import WorldInfo
from agang._setup.interface import Link, apply_interface, choose_interface, disagreement, own_link
from agang._setup.rendezvous import _host, check_in, listen_on

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


def test_ranks_on_different_networks_are_warned_about_once_by_rank_0_and_the_odd_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each rank checks in with its interface's network; names may differ between hosts
    (``data0``, ``data1``), networks should not: rank 0 warns, and so does the rank that
    differs from it, naming both sides; the ranks on rank 0's network stay quiet."""
    store = dist.HashStore()  # type: ignore[attr-defined]
    links = {
        0: Link("data0", "10.201.0.1", "10.201.0.0/24"),
        1: Link("data1", "10.201.0.2", "10.201.0.0/24"),
        2: Link("mgmt2", "10.202.0.3", "10.202.0.0/24"),
    }
    members: dict[int, Any] = {}

    def rank(r: int) -> None:
        world = WorldInfo(r, 3, 0, "10.201.0.1", 29500, launcher_hosts_store=True)
        members[r] = check_in(
            store,
            world,
            "p",
            deadline=time.monotonic() + 30,
            cancelled=threading.Event(),
            link=links[r],
        )

    caplog.set_level(logging.WARNING, logger="agang")
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert [m.link for m in members[1]] == [links[0], links[1], links[2]]
    assert members[0][2].describe().endswith(f" 10.202.0.3, pid {os.getpid()}")
    warnings = [r.getMessage() for r in caplog.records if "different networks" in r.getMessage()]
    assert len(warnings) == 2, warnings  # rank 0's and rank 2's
    assert "ranks [0, 1] on 10.201.0.0/24; ranks [2] on 10.202.0.0/24" in warnings[0]
    assert disagreement({0: links[0], 1: links[1]}) is None


def test_this_ranks_link_is_the_named_interface_or_the_one_reaching_master_addr() -> None:
    assert own_link("127.0.0.1", {}) == Link("lo", "127.0.0.1", "127.0.0.0/8")
    assert own_link("10.9.9.9", {"GLOO_SOCKET_IFNAME": "lo"}) == Link(
        "lo", "127.0.0.1", "127.0.0.0/8"
    )
    assert Link.from_text(Link("eth0", None, None).to_text()) == Link("eth0", None, None)
