"""Which interface the worker binds gloo/NCCL to (`agent.worker.netbind`), on this host's own
interfaces: loopback addresses map to the loopback interface, an explicit operator choice wins
and must exist, an unresolvable bind address fails with a message naming what to fix."""

from __future__ import annotations

import socket

import pytest

from agent.worker import netbind
from agent.worker.netbind import BindChoice, apply, choose

LOOPBACK = netbind.loopback_interface()


def test_loopback_bind_addr_maps_to_the_loopback_interface() -> None:
    assert LOOPBACK == "lo" or netbind.ipv4_of(LOOPBACK) == "127.0.0.1"
    for addr in ("127.0.0.1", "127.0.1.1", "localhost"):
        assert choose(addr, "127.0.0.1", env={}).interface == LOOPBACK


def test_ipv6_loopback_maps_to_the_loopback_interface() -> None:
    assert netbind.interface_holding("::1") == LOOPBACK


def test_an_address_of_a_real_interface_maps_to_it() -> None:
    for name in netbind.interface_names():
        addr = netbind.ipv4_of(name)
        if addr and not addr.startswith("127."):
            assert choose(addr, "127.0.0.1", env={}).interface == name
            return
    pytest.skip("no non-loopback IPv4 interface on this host")


def test_ipv6_addresses_come_from_proc(tmp_path) -> None:  # type: ignore[no-untyped-def]
    table = tmp_path / "if_inet6"
    table.write_text(
        "00000000000000000000000000000001 01 80 10 80       lo\n"
        "fd000000000000000000000000000002 02 40 00 80     eth0\n"
    )
    assert netbind.ipv6_interfaces(str(table)) == {"::1": "lo", "fd00::2": "eth0"}


def test_explicit_interface_wins_and_must_exist() -> None:
    env = {netbind.ENV_BIND_INTERFACE: LOOPBACK, netbind.GLOO_ENV: "eth9"}
    assert choose("10.1.2.3", "10.1.2.4", env=env).interface == LOOPBACK
    with pytest.raises(ValueError, match="--bind-interface 'nosuch0'.*DTFM_BIND_INTERFACE"):
        choose("127.0.0.1", "127.0.0.1", env={netbind.ENV_BIND_INTERFACE: "nosuch0"})


def test_an_operators_gloo_socket_ifname_is_respected() -> None:
    choice = choose("127.0.0.1", "127.0.0.1", env={netbind.GLOO_ENV: "eth7"})
    assert choice.interface == "eth7"


def test_unresolvable_bind_addr_is_a_clear_value_error() -> None:
    with pytest.raises(ValueError, match="bind_addr 'no-such-host.invalid' does not resolve"):
        choose("no-such-host.invalid", "127.0.0.1", env={})


def test_foreign_bind_addr_falls_back_to_the_route_then_to_nothing() -> None:
    # 192.0.2.77 (TEST-NET-1) is on no interface here; the master on loopback gives no route.
    if netbind.interface_holding("192.0.2.77") is not None:
        pytest.skip("this host holds 192.0.2.77")
    assert choose("192.0.2.77", "127.0.0.1", env={}).interface is None
    assert choose("", "", env={}).interface is None


def test_route_source_of_a_loopback_master_is_loopback() -> None:
    assert netbind.route_source("127.0.0.1") == "127.0.0.1"


def test_apply_sets_gloo_and_an_exact_nccl_match() -> None:
    env: dict[str, str] = {}
    apply(BindChoice("lo", "test"), "nccl", env=env)
    assert env == {netbind.GLOO_ENV: "lo", netbind.NCCL_ENV: "=lo"}
    env = {netbind.GLOO_ENV: "eth0", netbind.NCCL_ENV: "eth0"}
    apply(BindChoice("eth0", "operator"), "nccl", env=env)
    assert env == {netbind.GLOO_ENV: "eth0", netbind.NCCL_ENV: "eth0"}  # respected
    env = {}
    apply(BindChoice(None, "nothing"), "gloo", env=env)
    assert env == {}


def test_interface_names_match_the_kernel() -> None:
    assert netbind.interface_names() == [n for _, n in socket.if_nameindex()]
