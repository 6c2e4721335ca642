"""How many connections the shared port's front (dtfm/net/front.py) may hold, in total and per
source address, and the refusals' log (issue 41: ~140 silent connections used to exhaust a
coordinator's 1,024 descriptors).

The front holds two kinds of connection, each bounded in total and per source:

- *sniffing*: accepted, not yet sorted (at most the sniff deadline, 10 s by default). One
  descriptor each. An honest client leaves this state after one round trip, so the bound
  only has to cover a burst of reconnections (a NAT'd site of agents after a restart);
- *gRPC*: spliced to the daemon's gRPC server. Three descriptors each: the accepted TCP
  socket and the front's end of the Unix socket to gRPC, plus gRPC's own end. Kernel pipes
  are lent only while bytes are in flight, from a pool of `pipes` (two descriptors each).

The defaults come from the open-file soft limit (RLIMIT_NOFILE) at start: the front takes at
most half of it (`SHARE`), leaving the rest to gRPC's listeners and channels, checkpoint
files, the relay, workers' pipes and logs. Of that half, 1/32 goes to pipes (4 to 64 pipes),
1/8 to sniffing (16 to 256) and the rest to gRPC connections at 3 descriptors each. A single
source may use a quarter of either bound (at least 8 gRPC connections, 4 sniffing), so one
address cannot take everything, yet a site of agents behind one NAT address still fits.

With systemd's default soft limit of 1,024 that is 138 gRPC connections (34 per source): a
coordinator of ~60 agents (two channels each), with the process far from 1,024. A
coordinator of ~1,000 agents needs 2,000 connections, so a soft limit of at least 16,384
(`LimitNOFILE=`), which gives 2,602 gRPC connections. The front logs its bounds at start,
with the limit they came from. A source is its IPv4 address, or its IPv6 /64 (one host
usually holds a whole /64).
"""

from __future__ import annotations

import ipaddress
import resource
from collections import Counter
from dataclasses import dataclass

SHARE = 0.5  # of the open-file soft limit, for the front's connections and pipes
FDS_PER_GRPC = 3  # accepted socket, the front's Unix socket to gRPC, gRPC's end of it
_UNLIMITED = 1 << 20  # an infinite soft limit is taken as this many


def _clamp(v: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, v))


@dataclass(frozen=True)
class FrontLimits:
    """Bounds on what one front holds at once (see the module docstring for the defaults)."""

    grpc: int  # spliced gRPC connections
    grpc_per_source: int
    sniffing: int  # connections accepted, not yet sorted
    sniffing_per_source: int
    pipes: int  # kernel pipes lent to splices while bytes are in flight
    nofile: int = 0  # the soft limit these were derived from (0: given by hand)

    @staticmethod
    def for_open_files(nofile: int) -> FrontLimits:
        """The default bounds for an open-file soft limit of `nofile`."""
        share = int(nofile * SHARE)
        pipes = _clamp(share // 32, 4, 64)
        sniffing = _clamp(share // 8, 16, 256)
        grpc = max(16, (share - 2 * pipes - sniffing) // FDS_PER_GRPC)
        return FrontLimits(grpc=grpc, grpc_per_source=max(8, grpc // 4), sniffing=sniffing,
                           sniffing_per_source=max(4, sniffing // 4), pipes=pipes,
                           nofile=nofile)

    @staticmethod
    def from_rlimit() -> FrontLimits:
        """The default bounds for this process's open-file soft limit, read now."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return FrontLimits.for_open_files(_UNLIMITED if soft == resource.RLIM_INFINITY
                                          else soft)

    def describe(self) -> str:
        src = (f"from the open-file soft limit {self.nofile}; raise LimitNOFILE for more"
               if self.nofile else "as configured")
        return (f"at most {self.grpc} gRPC connections ({self.grpc_per_source} per source), "
                f"{self.sniffing} being sorted ({self.sniffing_per_source} per source), "
                f"{self.pipes} pipes ({src})")


def source_of(host: str) -> str:
    """The source a peer address counts against: an IPv4 address (also when mapped into
    IPv6), or an IPv6 address's /64."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return "unknown"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class Tally:
    """Connections of one kind held now, in total and per source, against their bounds."""

    def __init__(self, what: str, total: int, per_source: int) -> None:
        self.what, self.total, self.per_source = what, total, per_source
        self._by_source: Counter[str] = Counter()
        self._held = 0

    def __len__(self) -> int:
        return self._held

    def admit(self, source: str) -> str | None:
        """Count one more from `source`; None when admitted, else why not (nothing counted)."""
        if self._held >= self.total:
            return f"{self.total} {self.what} connections already held (all sources)"
        if self._by_source[source] >= self.per_source:
            return f"{self.per_source} {self.what} connections already held from {source}"
        self._held += 1
        self._by_source[source] += 1
        return None

    def release(self, source: str) -> None:
        self._held -= 1
        self._by_source[source] -= 1
        if self._by_source[source] <= 0:
            del self._by_source[source]

    def held_by(self, source: str) -> int:
        return self._by_source[source]

