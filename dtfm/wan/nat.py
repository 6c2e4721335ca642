"""Reachability in the WAN emulator: hosts behind a NAT or a stateful firewall.

Owns the per-packet decision of the forwarder (:mod:`dtfm.wan.emulator`) for a WAN whose hosts
are not all publicly reachable: where a packet goes, how its addresses and ports are rewritten,
and whether it is dropped; and where each host sits (`layout`, `Sites`: the addresses, who
can dial whom), which the harness (:mod:`dtfm.wan.harness`) answers from. It does no I/O,
so it is tested without root too.

Each host has one of three reachability modes:

- ``public``: its address is on the emulated Internet; anyone may dial it (as before).
- ``firewall``: its address is public, but a stateful firewall in front of it drops every
  inbound packet that is not part of a flow the host opened (a flow: protocol, its port, the
  remote address and port). An inbound TCP SYN, or a datagram to a port the host did not send
  from to that sender, is dropped; replies to what it opened pass.
- ``nat``: the host sits on a private LAN (``192.168.1.0/24``) behind a NAT with its own public
  address. Hosts behind *different* NATs may hold the same private address (every home router
  hands out 192.168.1.2), so a host is identified by its index, never by the address it
  believes is its own. Several hosts may share one NAT (a site): they reach each other directly
  at their (distinct) private addresses, and everyone else sees the one public address.

Why translation in the forwarder and not a kernel NAT in a router namespace: this machine has
neither ``iptables`` nor ``nft``, and the forwarder already sees every packet between hosts, so
translating there keeps one namespace per host, needs no extra tools, and keeps a NAT's delay and
rate the host's own links (a packet from a NATed host to host j takes the link ``(host, j)``).

The NAT behaves as RFC 4787/5382 describe a well-behaved home router:

- **Endpoint-independent mapping**: one private (address, port) gets one public port for every
  destination (so hole punching through it can work), allocated sequentially from 20000-65535
  per NAT and protocol; the private port is *not* preserved, so a peer sees a mapped port.
- **Address- and port-dependent filtering**: an inbound packet to a mapped port is translated
  back only if it comes from an (address, port) the mapping has sent to; everything else
  addressed to the NAT (no mapping, another sender, another protocol) is dropped.
- Hairpinning: a host may reach a host behind the same NAT at the NAT's public address and
  mapped port.
- TCP and UDP are translated; IP checksums and TCP/UDP checksums are updated incrementally
  (RFC 1624). Other protocols (ICMP included) and IP fragments from or to a NATed host are
  dropped; the emulator's large MTU leaves TCP and UDP unfragmented.
- Mappings (and a firewall's flows) expire when idle: UDP after 120 s, TCP after 7440 s, and a
  TCP flow 10 s after an RST or a FIN each way. The expiry is refreshed by traffic either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PUBLIC, FIREWALL, NAT = "public", "firewall", "nat"
MODES = (PUBLIC, FIREWALL, NAT)
LAN_PREFIX = "192.168.1."
TCP, UDP = 6, 17
PORT_FIRST, PORT_LAST = 20000, 65535
UDP_TIMEOUT_S = 120.0
TCP_TIMEOUT_S = 7440.0
TCP_CLOSING_S = 10.0
_FIN, _SYN, _RST, _ACK = 0x01, 0x02, 0x04, 0x10
_SWEEP_EVERY = 4096  # new entries between sweeps of the expired ones

# why each drop happened, counted in Router.counters (and the emulator's stats)
DROP_FIREWALL = "dropped_firewall"  # inbound to a firewalled host, not of a flow it opened
DROP_NAT_INBOUND = "dropped_nat_inbound"  # to a NAT's address: no mapping, or filtered
DROP_NAT_PROTOCOL = "dropped_nat_protocol"  # not TCP/UDP, or a fragment, from/to a NAT
DROP_NAT_FULL = "dropped_nat_full"  # a NAT out of public ports
DROP_UNROUTABLE = "dropped_unroutable"


def checksum_adjust(checksum: int, old: bytes, new: bytes) -> int:
    """The Internet checksum after the even-length field ``old`` became ``new`` (RFC 1624,
    eqn. 3: HC' = ~(~HC + ~m + m'), summed over the field's 16-bit words)."""
    total = ~checksum & 0xFFFF
    for k in range(0, len(old), 2):
        total += (~((old[k] << 8) | old[k + 1]) & 0xFFFF) + ((new[k] << 8) | new[k + 1])
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _l4(pkt: bytearray) -> tuple[int, int] | None:
    """(protocol, offset of its header) for an unfragmented TCP or UDP packet; else None."""
    if ((pkt[6] << 8) | pkt[7]) & 0x3FFF:  # MF set or a fragment offset
        return None
    proto, off = pkt[9], (pkt[0] & 0x0F) * 4
    if proto == TCP and len(pkt) >= off + 20 or proto == UDP and len(pkt) >= off + 8:
        return proto, off
    return None


def _rewrite(pkt: bytearray, proto: int, off: int, addr_at: int, addr: bytes, port_at: int,
             port: int) -> None:
    """Put ``addr`` at ``addr_at`` (12: source, 16: destination) and ``port`` at ``off +
    port_at``; fix the IP header checksum and the TCP/UDP one (it covers the addresses too)."""
    old = bytes(pkt[addr_at:addr_at + 4]) + bytes(pkt[off + port_at:off + port_at + 2])
    new = addr + port.to_bytes(2, "big")
    pkt[10:12] = checksum_adjust(int.from_bytes(pkt[10:12], "big"), old[:4], new[:4]
                                 ).to_bytes(2, "big")
    at = off + (16 if proto == TCP else 6)
    csum = int.from_bytes(pkt[at:at + 2], "big")
    if proto == TCP or csum != 0:  # a UDP checksum of 0 means "none": leave it so
        csum = checksum_adjust(csum, old, new)
        pkt[at:at + 2] = (csum or (0xFFFF if proto == UDP else 0)).to_bytes(2, "big")
    pkt[addr_at:addr_at + 4] = addr
    pkt[off + port_at:off + port_at + 2] = new[4:]


@dataclass
class _Flow:
    """Timing state of a mapping or a firewall flow: when it expires, and TCP's closing."""

    expires: float = 0.0
    fin_out: bool = False
    fin_in: bool = False

    def touch(self, proto: int, flags: int, outbound: bool, now: float) -> None:
        if proto != TCP:
            self.expires = now + UDP_TIMEOUT_S
            return
        if outbound and flags & (_SYN | _ACK) == _SYN:  # a new connection reuses the port
            self.fin_out = self.fin_in = False
        if flags & _FIN:
            if outbound:
                self.fin_out = True
            else:
                self.fin_in = True
        closing = flags & _RST or (self.fin_out and self.fin_in)
        self.expires = now + (TCP_CLOSING_S if closing else TCP_TIMEOUT_S)


@dataclass
class _Mapping(_Flow):
    host: int = 0
    proto: int = 0
    private_addr: bytes = b""
    private_port: int = 0
    public_port: int = 0
    peers: set[tuple[bytes, int]] = field(default_factory=set)  # the filter: who may answer


@dataclass
class Site:
    """One NAT: its public address and the hosts on its LAN (private address -> host)."""

    public: bytes
    lan: dict[bytes, int]
    by_private: dict[tuple[int, bytes, int], _Mapping] = field(default_factory=dict)
    by_public: dict[tuple[int, int], _Mapping] = field(default_factory=dict)
    next_port: int = PORT_FIRST
    created: int = 0


class Router:
    """Where each packet goes: ``route(src, pkt, now)`` rewrites ``pkt`` in place and returns
    the destination host, or None (dropped; ``counters`` says why).

    ``public``: the public address of every host that has one (public and firewalled hosts), or
    None for NATed hosts; ``firewalled``: the hosts behind a stateful firewall; ``sites``: per
    NAT, its public address and its LAN (private address -> host)."""

    def __init__(self, public: list[bytes | None], firewalled: set[int],
                 sites: list[tuple[bytes, dict[bytes, int]]]) -> None:
        self.host_at = {addr: i for i, addr in enumerate(public) if addr is not None}
        self.firewalled = set(firewalled)
        self.sites = [Site(addr, dict(lan)) for addr, lan in sites]
        self.site_at = {s.public: s for s in self.sites}
        self.site_of: list[Site | None] = [None] * len(public)
        for s in self.sites:
            for host in s.lan.values():
                self.site_of[host] = s
        self.flows: dict[int, dict[tuple[int, int, bytes, int], _Flow]] = {
            h: {} for h in self.firewalled}
        self._flows_created = dict.fromkeys(self.firewalled, 0)
        self.counters = dict.fromkeys(
            (DROP_FIREWALL, DROP_NAT_INBOUND, DROP_NAT_PROTOCOL, DROP_NAT_FULL), 0)
        self.counters["nat_mappings_created"] = 0

    def _drop(self, why: str) -> None:
        self.counters[why] = self.counters.get(why, 0) + 1

    def route(self, src: int, pkt: bytearray, now: float) -> int | None:
        dst_addr = bytes(pkt[16:20])
        site = self.site_of[src]
        if site is not None:
            neighbour = site.lan.get(dst_addr)
            if neighbour is not None:  # on the LAN: no NAT in between
                return neighbour if neighbour != src else None
            if not self._outbound_nat(site, src, pkt, now):
                return None
        elif src in self.firewalled:
            self._outbound_firewall(src, pkt, now)
        # now a packet on the Internet, from a public address
        dst = self.host_at.get(dst_addr)
        if dst is not None:
            if dst == src:
                self._drop(DROP_UNROUTABLE)
                return None
            if dst in self.firewalled and not self._inbound_firewall(dst, pkt, now):
                self._drop(DROP_FIREWALL)
                return None
            return dst
        target = self.site_at.get(dst_addr)
        if target is not None:
            return self._inbound_nat(target, pkt, now)
        self._drop(DROP_UNROUTABLE)
        return None

    # ---- the firewall

    def _flow_key(self, pkt: bytearray, outbound: bool) -> tuple[tuple[int, int, bytes, int],
                                                                 int, int]:
        """((protocol, the host's port, remote address, remote port), protocol, TCP flags);
        ports are 0 for protocols without them."""
        parsed = _l4(pkt)
        proto, flags = pkt[9], 0
        local_port = remote_port = 0
        if parsed is not None:
            off = parsed[1]
            sport = int.from_bytes(pkt[off:off + 2], "big")
            dport = int.from_bytes(pkt[off + 2:off + 4], "big")
            local_port, remote_port = (sport, dport) if outbound else (dport, sport)
            if proto == TCP:
                flags = pkt[off + 13]
        remote = bytes(pkt[16:20] if outbound else pkt[12:16])
        return (proto, local_port, remote, remote_port), proto, flags

    def _outbound_firewall(self, host: int, pkt: bytearray, now: float) -> None:
        key, proto, flags = self._flow_key(pkt, outbound=True)
        flows = self.flows[host]
        flow = flows.get(key)
        if flow is None:
            flow = flows[key] = _Flow()
            self._flows_created[host] += 1
            if self._flows_created[host] % _SWEEP_EVERY == 0:
                for k in [k for k, f in flows.items() if f.expires < now]:
                    del flows[k]
        flow.touch(proto, flags, True, now)

    def _inbound_firewall(self, host: int, pkt: bytearray, now: float) -> bool:
        key, proto, flags = self._flow_key(pkt, outbound=False)
        flow = self.flows[host].get(key)
        if flow is None or flow.expires < now:
            return False
        flow.touch(proto, flags, False, now)
        return True

    # ---- the NAT

    def _outbound_nat(self, site: Site, src: int, pkt: bytearray, now: float) -> bool:
        parsed = _l4(pkt)
        if parsed is None:
            self._drop(DROP_NAT_PROTOCOL)
            return False
        proto, off = parsed
        key = (proto, bytes(pkt[12:16]), int.from_bytes(pkt[off:off + 2], "big"))
        m = site.by_private.get(key)
        if m is None or m.expires < now:
            m = self._allocate(site, src, key, now)
            if m is None:
                self._drop(DROP_NAT_FULL)
                return False
        m.peers.add((bytes(pkt[16:20]), int.from_bytes(pkt[off + 2:off + 4], "big")))
        m.touch(proto, pkt[off + 13] if proto == TCP else 0, True, now)
        _rewrite(pkt, proto, off, 12, site.public, 0, m.public_port)
        return True

    def _allocate(self, site: Site, host: int, key: tuple[int, bytes, int], now: float
                  ) -> _Mapping | None:
        old = site.by_private.pop(key, None)
        if old is not None:
            site.by_public.pop((old.proto, old.public_port), None)
        span = PORT_LAST - PORT_FIRST + 1
        for _ in range(span):
            port = site.next_port
            site.next_port = PORT_FIRST + (port + 1 - PORT_FIRST) % span
            taken = site.by_public.get((key[0], port))
            if taken is not None:
                if taken.expires >= now:
                    continue
                del site.by_private[(taken.proto, taken.private_addr, taken.private_port)]
            m = _Mapping(host=host, proto=key[0], private_addr=key[1], private_port=key[2],
                         public_port=port)
            site.by_private[key] = site.by_public[(key[0], port)] = m
            site.created += 1
            self.counters["nat_mappings_created"] += 1
            if site.created % _SWEEP_EVERY == 0:
                self._sweep(site, now)
            return m
        return None

    def _sweep(self, site: Site, now: float) -> None:
        for m in [m for m in site.by_public.values() if m.expires < now]:
            del site.by_public[(m.proto, m.public_port)]
            del site.by_private[(m.proto, m.private_addr, m.private_port)]

    def _inbound_nat(self, site: Site, pkt: bytearray, now: float) -> int | None:
        parsed = _l4(pkt)
        if parsed is None:
            self._drop(DROP_NAT_PROTOCOL)
            return None
        proto, off = parsed
        m = site.by_public.get((proto, int.from_bytes(pkt[off + 2:off + 4], "big")))
        if (m is None or m.expires < now
                or (bytes(pkt[12:16]), int.from_bytes(pkt[off:off + 2], "big")) not in m.peers):
            self._drop(DROP_NAT_INBOUND)
            return None
        m.touch(proto, pkt[off + 13] if proto == TCP else 0, False, now)
        _rewrite(pkt, proto, off, 16, m.private_addr, 2, m.private_port)
        return m.host

    def forget(self) -> int:
        """Drop every mapping, as a NAT that reboots or runs out of table does; the next
        packet of a flow out gets a new public port, so the peer, which knows only the old
        one, answers its segments with a reset. Returns how many mappings went."""
        gone = sum(len(s.by_public) for s in self.sites)
        for s in self.sites:
            s.by_public.clear()
            s.by_private.clear()
        return gone

    def mappings(self) -> list[dict[str, object]]:
        """Every live NAT mapping (for the control socket's ``get``)."""
        return [{"host": m.host, "proto": "tcp" if m.proto == TCP else "udp",
                 "private": f"{_dotted(m.private_addr)}:{m.private_port}",
                 "public": f"{_dotted(s.public)}:{m.public_port}"}
                for s in self.sites for m in s.by_public.values()]


def _dotted(addr: bytes) -> str:
    return ".".join(str(b) for b in addr)


@dataclass(frozen=True)
class HostPlace:
    """Where one host sits: its mode, its own address (bind here), the address peers see, and
    its NAT (an index shared by the hosts behind one NAT; None for public and firewalled)."""

    reachability: str
    address: str
    public_address: str
    site: int | None


def layout(public_addresses: list[str], nat: list[int] | tuple[int, ...] = (),
           firewall: list[int] | tuple[int, ...] = (),
           shared_nat: list[list[int]] | tuple[tuple[int, ...], ...] = ()) -> list[HostPlace]:
    """Place hosts: host i would own ``public_addresses[i]``; the hosts in ``nat`` sit behind a
    NAT of their own and those of each ``shared_nat`` group behind one NAT together; those in
    ``firewall`` keep their address behind a stateful firewall.

    A NAT's public address is that of its lowest host. Behind every NAT the first host is
    192.168.1.2, the next 192.168.1.3, ...: hosts behind different NATs share private
    addresses, as behind different home routers."""
    n = len(public_addresses)

    def check(host: object, what: str) -> int:
        if not isinstance(host, int) or isinstance(host, bool) or not 0 <= host < n:
            raise ValueError(f"{what}: host {host!r} is not one of the hosts 0..{n - 1}")
        return host

    groups: list[list[int]] = []
    grouped: set[int] = set()
    for group in shared_nat:
        members = sorted({check(h, "shared_nat") for h in group})
        if len(members) < 2:
            raise ValueError(f"shared_nat group {list(group)} has fewer than two hosts: list "
                             "a host with a NAT of its own in nat")
        if grouped & set(members):
            raise ValueError(f"shared_nat: host(s) {sorted(grouped & set(members))} are in "
                             "two groups; a host sits behind one NAT")
        grouped |= set(members)
        groups.append(members)
    natted = {check(h, "nat") for h in nat} | grouped
    walled = {check(h, "firewall") for h in firewall}
    if natted & walled:
        raise ValueError(f"host(s) {sorted(natted & walled)} are both behind a NAT and "
                         "firewalled: give each host one mode")
    groups += [[h] for h in sorted(natted - grouped)]
    groups.sort()
    places: list[HostPlace | None] = [None] * n
    for site, members in enumerate(groups):
        if len(members) > 250:
            raise ValueError(f"a NAT's LAN holds at most 250 hosts; got {len(members)}")
        pub = public_addresses[members[0]]
        for k, host in enumerate(members):
            places[host] = HostPlace(NAT, f"{LAN_PREFIX}{k + 2}", pub, site)
    return [p if p is not None else
            HostPlace(FIREWALL if i in walled else PUBLIC, public_addresses[i],
                      public_addresses[i], None)
            for i, p in enumerate(places)]


class Sites:
    """Where every host of one WAN sits (its `HostPlace`, from `layout`), as the harness asks:
    the address a host binds, the one its peers see, its mode and NAT, and who can dial whom.
    Hosts are numbered 0..n-1; any other number is an IndexError."""

    def __init__(self, places: list[HostPlace]) -> None:
        self.places = list(places)

    def index(self, i: int) -> int:
        """``i``, checked to be one of the hosts."""
        if not 0 <= i < len(self.places):
            raise IndexError(f"host {i} out of range [0, {len(self.places)})")
        return i

    def address(self, i: int) -> str:
        """Host ``i``'s own address: where it binds (behind a NAT a private one)."""
        return self.places[self.index(i)].address

    def public_address(self, i: int) -> str:
        """The address host ``i``'s peers see: its NAT's public address if it is behind a NAT
        (with a mapped port per connection), else its own."""
        return self.places[self.index(i)].public_address

    def reachability(self, i: int) -> str:
        """``"public"``, ``"firewall"`` or ``"nat"``."""
        return self.places[self.index(i)].reachability

    def nat_site(self, i: int) -> int | None:
        """Which NAT host ``i`` sits behind (hosts with the same one share a LAN); None if it
        is not behind a NAT."""
        return self.places[self.index(i)].site

    def dialable(self, src: int, dst: int) -> bool:
        """Whether host ``src`` can open a connection to host ``dst`` at ``address(dst)``: a
        public host from anywhere, a NATed host only from behind the same NAT, a firewalled
        host from nowhere."""
        mode = self.reachability(dst)
        if mode == NAT:
            return self.nat_site(src) == self.nat_site(dst) and self.index(src) != dst
        return mode == PUBLIC and self.index(src) != dst
