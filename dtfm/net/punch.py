"""Hole punching: two ranks behind NATs open a direct TCP connection and leave the relay.

Two ranks that both only dial out meet at a relay (`dtfm/net/relay.py`), which costs two hops
and a share of the relay's uplink. Most home and office NATs map one private (address, port)
to one public port whatever the destination ("endpoint-independent mapping", RFC 4787/5382),
and let packets in from an address and port the host has sent to. So, once both ends are at
the relay:

1. each end dialled the relay from a port it may bind again (`dial_reusable`), and the relay
   told it the address and port it saw the *other* end come from (`partner_address`): behind
   a NAT, the NAT's public address and the port it mapped;
2. both ends, at once, connect from that same local port to the other's observed address
   (`simultaneous_open`): each one's SYN opens its own NAT for the other's, and TCP's
   simultaneous open joins the two into one connection;
3. the direct connection runs the job-key handshake like any other (the lower rank as the
   dialler), and each end tells the other over the relay circuit whether it got through
   (`agree`). Only when both did is the direct connection a candidate; otherwise both stay
   on the relay, which always works. Both ends decide from the same two bytes, so they never
   disagree on the path;
4. both ends time the two paths with the same exchange and keep the direct one only where
   it is not slower than the relay (pathweigh.py): the scheduler priced the pair by the
   path this rule picks on the figures link measurement had (the direct ones from a punch
   probe, agent/probing/punchprobe.py, where it got through; else the relay's), and a slower path
   than that would make the job slower than planned.

Link measurement uses steps 1-3 too (`punch(..., weigh=False)`): the pair meets at the
coordinator's relay as a pseudo-job and measures the punched connection itself.

Where it does not work: a NAT that maps every destination to a new port (symmetric NATs,
some carrier-grade NATs) gives the relay a port the peer cannot use, and the punch times out
(`PUNCH_S`) into the relay. On the WAN emulator (dtfm/wan/nat.py: endpoint-independent
mapping, address- and port-dependent filtering) it works between hosts behind different
NATs, behind one NAT (hairpinning), and behind stateful firewalls. Not tried where the relay
saw the peer at a loopback address (`on_loopback`), nor with `coordinator start --hole-punch
off` (`DataPlane.hole_punch`); both ends still read the relay's frame and stay on it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
import time

from dtfm.net import dataplane as dp
from dtfm.net import pathweigh

log = logging.getLogger(__name__)

PUNCH_S = 4.0  # how long both ends try: a first SYN lost at the far NAT is resent after 1 s
_RETRY_S = 0.05  # between attempts refused outright (no NAT between: nobody connecting yet)


def _reusable(family: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if hasattr(socket, "SO_REUSEPORT"):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    return sock


def dial_reusable(host: str, port: int, timeout_s: float) -> socket.socket:
    """A connection to HOST:PORT from a local port a second socket may bind too (the punch
    leaves from the port the relay saw)."""
    err: OSError | None = None
    for family, _, _, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = _reusable(family)
        sock.settimeout(timeout_s)
        try:
            sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
            sock.connect(addr)
            return sock
        except OSError as exc:
            sock.close()
            err = exc
    raise err if err is not None else OSError(f"no address for {host}:{port}")


def partner_address(sock: socket.socket, job: bytes, epoch: int, me: int, peer: int,
                    timeout_s: float) -> str:
    """The relay's first frame on a circuit: where it saw `peer` dial from (HOST:PORT)."""
    sock.settimeout(timeout_s)
    return dp.read_control(sock, job, epoch, me, peer, dp.OBSERVED_TAG, range(257),
                    f"the relay's circuit to rank {peer} did not start with the peer's "
                    f"observed address: a relay of another version?").decode()


def simultaneous_open(local: tuple[str, int], remote: str, deadline_s: float
                      ) -> socket.socket | None:
    """Connect from `local` (HOST, PORT) to `remote` until it connects or `deadline_s` has
    passed; None then. The peer does the same towards us meanwhile."""
    host, port = dp.parse_addr(remote)
    end = time.monotonic() + deadline_s
    while (left := end - time.monotonic()) > 0:
        sock = _reusable(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.settimeout(left)
        try:
            sock.bind(local)
            sock.connect((host, port))
            return sock
        except OSError:
            sock.close()
            time.sleep(min(_RETRY_S, max(0.0, end - time.monotonic())))
    return None


def on_loopback(addr: str) -> bool:
    """Whether the relay saw the peer at a loopback address: both ends share the relay's
    host, where no NAT sits between them (they were marked unreachable by hand, e.g.
    `--reachable no`) and the relay is as near as a direct path. Not punched: a simultaneous
    open without a NAT to hold the SYNs is refused outright, over and over."""
    try:
        return ipaddress.ip_address(dp.parse_addr(addr)[0]).is_loopback
    except ValueError:
        return False


def agree(relay: socket.socket, job: bytes, epoch: int, me: int, peer: int, ok: bool,
          timeout_s: float) -> bool:
    """Tell `peer` over the relay whether our punch got through, hear whether its did: True
    when both did (both ends compute the same answer)."""
    relay.settimeout(timeout_s)
    relay.sendall(dp.control_frame(job, epoch, me, peer, dp.PUNCHED_TAG, bytes([ok])))
    theirs = dp.read_control(relay, job, epoch, me, peer, dp.PUNCHED_TAG, range(1, 2),
                      f"rank {peer} answered the hole punch with another frame: the two ends "
                      f"run different dtfm versions?")
    return ok and theirs == b"\x01"


def punch(relay: socket.socket, key: bytes, job: str, epoch: int, me: int, peer: int,
          observed: str, deadline_s: float = PUNCH_S, weigh: bool = True
          ) -> socket.socket | None:
    """Try a direct connection to `peer` at `observed` from the relay circuit's local port;
    the authenticated direct socket when both ends got through, None to stay on `relay`.
    `weigh=False` (link measurement, agent/probing/punchprobe.py: the direct path is what it
    measures) returns the direct socket without timing it against the relay; both ends must
    pass the same `weigh`."""
    digest = dp.job_digest(job)
    local = relay.getsockname()[:2]
    direct = None if on_loopback(observed) else simultaneous_open(local, observed, deadline_s)
    ok = False
    if direct is not None:
        try:
            direct.settimeout(10)
            role = dp.ROLE_DIAL if me < peer else dp.ROLE_ACCEPT
            theirs = dp.handshake(direct, key, job, epoch, role, me)
            ok = theirs.rank == peer and theirs.role != role
        except (OSError, dp.AuthError) as exc:
            log.info("rank %d: the direct connection to rank %d at %s failed its handshake "
                     "(%s): staying on the relay", me, peer, observed, exc)
    both = agree(relay, digest, epoch, me, peer, ok, max(deadline_s, 10.0) + 10.0)
    if not both:
        if direct is not None:
            with contextlib.suppress(OSError):
                direct.close()
        log.info("rank %d: no direct path to rank %d (%s): traffic goes through the relay",
                 me, peer, "we got through, it did not" if ok else
                 f"no connection to {observed} within {deadline_s:.0f} s")
        return None
    assert direct is not None
    if not weigh:
        return direct
    try:
        weighed = pathweigh.weigh(relay, direct, digest, epoch, me, peer,
                                  max(deadline_s, 10.0) + 20.0)
    except BaseException:
        with contextlib.suppress(OSError):
            direct.close()
        raise
    figures = (f"a {pathweigh.PROBE_BYTES // 1024} KiB round trip took "
               f"{weighed.direct_s * 1e3:.1f} ms direct, {weighed.relay_s * 1e3:.1f} ms "
               f"through the relay")
    if not weighed.direct:
        with contextlib.suppress(OSError):
            direct.close()
        log.info("rank %d: got through to rank %d at %s, but the relay is faster (%s): "
                 "traffic stays on the relay", me, peer, observed, figures)
        return None
    log.info("rank %d: hole punched to rank %d at %s: direct, off the relay (%s)", me, peer,
             observed, figures)
    return direct
