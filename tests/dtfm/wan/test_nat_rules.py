"""The NAT and firewall rules of the WAN emulator (dtfm.wan.nat) on crafted packets, no root.

Checksums after translation equal a full recomputation; the host layout refuses contradictory
input with a reason; a mapping expires when idle and a TCP one soon after it closes; a
firewall lets in only what its host opened.
"""

from __future__ import annotations

import socket
import struct

import pytest

from dtfm.wan import nat
from dtfm.wan.emulator import Spec

PUBLIC = [f"10.9.0.{i + 1}" for i in range(4)]


def checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def packet(src: str, sport: int, dst: str, dport: int, proto: int = nat.TCP,
           flags: int = 0x02, payload: bytes = b"hello, world!") -> bytearray:
    """A valid IPv4 TCP or UDP packet with correct checksums."""
    s, d = socket.inet_aton(src), socket.inet_aton(dst)
    if proto == nat.TCP:
        l4 = struct.pack("!HHIIBBHHH", sport, dport, 1, 0, 5 << 4, flags, 65535, 0, 0) + payload
        at = 16
    else:
        l4 = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload
        at = 6
    pseudo = s + d + struct.pack("!BBH", 0, proto, len(l4))
    l4 = l4[:at] + struct.pack("!H", checksum(pseudo + l4)) + l4[at + 2:]
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(l4), 1, 0x4000, 64, proto, 0, s, d)
    ip = ip[:10] + struct.pack("!H", checksum(ip)) + ip[12:]
    return bytearray(ip + l4)


def checksums_ok(pkt: bytearray) -> bool:
    proto = pkt[9]
    l4 = bytes(pkt[20:])
    pseudo = bytes(pkt[12:20]) + struct.pack("!BBH", 0, proto, len(l4))
    return checksum(bytes(pkt[:20])) == 0 and checksum(pseudo + l4) == 0


def ports(pkt: bytearray) -> tuple[int, int]:
    sport, dport = struct.unpack("!HH", pkt[20:24])
    return sport, dport


def router(nat_hosts: list[int] = (), firewall: list[int] = (),
           shared: list[list[int]] = ()) -> tuple[nat.Router, list[nat.HostPlace]]:
    """The forwarder's router for these hosts, built as the forwarder builds it (its spec)."""
    places = nat.layout(PUBLIC, list(nat_hosts), list(firewall), [list(g) for g in shared])
    spec = Spec.from_json({
        "hosts": [{"namespace": f"ns{i}", "address": p.address, "reachability": p.reachability,
                   "public_address": p.public_address, "site": p.site}
                  for i, p in enumerate(places)],
        "delay_ms": [[0] * len(places) for _ in places]})
    r = spec.router()
    assert r is not None
    return r, places


@pytest.mark.parametrize("proto", [nat.TCP, nat.UDP], ids=["tcp", "udp"])
def test_translation_keeps_checksums_right(proto: int) -> None:
    r, places = router(nat_hosts=[1])
    out = packet(places[1].address, 40000, PUBLIC[0], 7000, proto)
    assert r.route(1, out, 0.0) == 0
    assert checksums_ok(out)
    assert socket.inet_ntoa(bytes(out[12:16])) == places[1].public_address
    mapped = ports(out)[0]
    assert mapped != 40000 and nat.PORT_FIRST <= mapped <= nat.PORT_LAST
    back = packet(PUBLIC[0], 7000, places[1].public_address, mapped, proto, flags=0x12)
    assert r.route(0, back, 0.0) == 1
    assert checksums_ok(back)
    assert socket.inet_ntoa(bytes(back[16:20])) == places[1].address
    assert ports(back) == (7000, 40000)


def test_mapping_is_endpoint_independent_and_filtering_is_not() -> None:
    r, places = router(nat_hosts=[1])
    first = packet(places[1].address, 40000, PUBLIC[0], 7000)
    second = packet(places[1].address, 40000, PUBLIC[2], 8000)
    r.route(1, first, 0.0)
    r.route(1, second, 0.0)
    mapped = ports(first)[0]
    assert ports(second)[0] == mapped  # same private endpoint, same public port
    pub = places[1].public_address
    assert r.route(3, packet(PUBLIC[3], 7000, pub, mapped, flags=0x12), 0.0) is None
    assert r.route(0, packet(PUBLIC[0], 7001, pub, mapped, flags=0x12), 0.0) is None
    assert r.route(0, packet(PUBLIC[0], 7000, pub, mapped + 1, flags=0x12), 0.0) is None
    assert r.counters[nat.DROP_NAT_INBOUND] == 3
    assert r.route(2, packet(PUBLIC[2], 8000, pub, mapped, flags=0x12), 0.0) == 1


def test_mappings_expire_when_idle_and_after_close() -> None:
    r, places = router(nat_hosts=[1])
    pub = places[1].public_address
    udp = packet(places[1].address, 5000, PUBLIC[0], 53, nat.UDP)
    r.route(1, udp, 0.0)
    mapped = ports(udp)[0]
    late = nat.UDP_TIMEOUT_S + 1
    assert r.route(0, packet(PUBLIC[0], 53, pub, mapped, nat.UDP), late) is None
    tcp = packet(places[1].address, 40000, PUBLIC[0], 7000)
    r.route(1, tcp, 0.0)
    mapped = ports(tcp)[0]
    r.route(1, packet(places[1].address, 40000, PUBLIC[0], 7000, flags=0x04), 1.0)  # RST
    assert r.route(0, packet(PUBLIC[0], 7000, pub, mapped, flags=0x10), 1.0 + nat.TCP_CLOSING_S
                   + 1) is None


def test_a_nat_that_forgets_maps_the_flow_anew_and_drops_what_comes_to_the_old_port() -> None:
    """`Router.forget` (the emulator's `forget_nat`): a rebooted home router. The peer's next
    segment to the old public port dies at the NAT; the host's next one leaves from a new
    port, which the peer's kernel knows nothing of (it answers with a reset)."""
    r, places = router(nat_hosts=[1])
    pub = places[1].public_address
    out = packet(places[1].address, 40000, PUBLIC[0], 7000)
    r.route(1, out, 0.0)
    old = ports(out)[0]
    assert r.forget() == 1 and r.mappings() == []
    assert r.route(0, packet(PUBLIC[0], 7000, pub, old, flags=0x10), 1.0) is None
    again = packet(places[1].address, 40000, PUBLIC[0], 7000, flags=0x10)
    r.route(1, again, 1.0)
    assert ports(again)[0] != old
    assert r.route(0, packet(PUBLIC[0], 7000, pub, ports(again)[0], flags=0x14), 1.0) == 1


def test_same_private_address_behind_two_nats() -> None:
    r, places = router(nat_hosts=[1, 2])
    assert places[1].address == places[2].address
    assert places[1].public_address != places[2].public_address
    a = packet(places[1].address, 40000, PUBLIC[0], 7000)
    b = packet(places[2].address, 40000, PUBLIC[0], 7000)
    r.route(1, a, 0.0)
    r.route(2, b, 0.0)
    for host, pkt in ((1, a), (2, b)):
        sport = ports(pkt)[0]
        reply = packet(PUBLIC[0], 7000, places[host].public_address, sport, flags=0x12)
        assert r.route(0, reply, 0.0) == host


def test_shared_nat_lan_and_hairpin() -> None:
    r, places = router(shared=[[1, 2]])
    assert places[1].address != places[2].address
    lan = packet(places[1].address, 40000, places[2].address, 7000)
    before = bytes(lan)
    assert r.route(1, lan, 0.0) == 2 and bytes(lan) == before  # untranslated on the LAN
    # from outside, a LAN address is nowhere
    assert r.route(0, packet(PUBLIC[0], 1, places[2].address, 7000), 0.0) is None
    # hairpin, as hole punching uses it: both learn their mapped ports from a public host...
    pub = places[1].public_address
    one = packet(places[1].address, 40001, PUBLIC[0], 7000)
    two = packet(places[2].address, 9000, PUBLIC[0], 7000)
    r.route(1, one, 0.0)
    r.route(2, two, 0.0)
    m1, m2 = ports(one)[0], ports(two)[0]
    # ...the first packet to the other's public endpoint is filtered (it never sent to us)...
    assert r.route(1, packet(places[1].address, 40001, pub, m2), 0.0) is None
    # ...and the answer comes in, translated twice, because host 1 had sent there
    pin = packet(places[2].address, 9000, pub, m1)
    assert r.route(2, pin, 0.0) == 1
    assert checksums_ok(pin)
    assert (socket.inet_ntoa(bytes(pin[12:16])), ports(pin)) == (pub, (m2, 40001))


def test_firewall_lets_in_only_what_its_host_opened() -> None:
    r, places = router(firewall=[2])
    me = places[2].address
    assert r.route(0, packet(PUBLIC[0], 40000, me, 7000), 0.0) is None  # inbound SYN
    assert r.route(0, packet(PUBLIC[0], 40000, me, 7000, nat.UDP), 0.0) is None
    assert r.counters[nat.DROP_FIREWALL] == 2
    out = packet(me, 41000, PUBLIC[0], 7000)
    assert r.route(2, out, 0.0) == 0 and ports(out) == (41000, 7000)  # no translation
    assert r.route(0, packet(PUBLIC[0], 7000, me, 41000, flags=0x12), 0.0) == 2
    assert r.route(0, packet(PUBLIC[0], 7001, me, 41000, flags=0x12), 0.0) is None
    assert r.route(1, packet(PUBLIC[1], 7000, me, 41000, flags=0x12), 0.0) is None


def test_all_public_keeps_the_fast_path() -> None:
    places = nat.layout(PUBLIC)
    spec = Spec.from_json({"hosts": [{"namespace": "x", "address": p.address} for p in places],
                           "delay_ms": [[0] * 4] * 4})
    assert spec.router() is None


def test_layout_refuses_contradictions() -> None:
    with pytest.raises(ValueError, match="both behind a NAT and firewalled"):
        nat.layout(PUBLIC, nat=[1], firewall=[1])
    with pytest.raises(ValueError, match="two groups"):
        nat.layout(PUBLIC, shared_nat=[[1, 2], [2, 3]])
    with pytest.raises(ValueError, match="fewer than two"):
        nat.layout(PUBLIC, shared_nat=[[1]])
    with pytest.raises(ValueError, match="not one of the hosts 0..3"):
        nat.layout(PUBLIC, nat=[4])
    places = nat.layout(PUBLIC, nat=[3], shared_nat=[[1, 2]])
    assert [p.reachability for p in places] == ["public", "nat", "nat", "nat"]
    assert places[1].public_address == places[2].public_address == PUBLIC[1]
    assert places[3].address == places[1].address == "192.168.1.2"
    assert places[2].address == "192.168.1.3"
