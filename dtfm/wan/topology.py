"""The shape of one emulated WAN: its hosts, their namespaces and addresses, and the links.

Owns what :class:`dtfm.wan.harness.WanEmulator` is built from and answers about its hosts: the
validated one-way delay and bandwidth matrices (row = from, column = to), each host's namespace
name, and where each host sits (public, firewalled or behind a NAT: a
:class:`dtfm.wan.nat.Sites`). Kept apart from the harness's lifecycle so the description can be
read (and checked) without root, and so a live change (:mod:`dtfm.wan.live`) has one place to
record what the links now are. It creates nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from dtfm.wan import nat as reach

DEFAULT_IFNAME = "wan0"  # each host's TUN device
NAME_PREFIX = "dtfm-"

Matrix = Sequence[Sequence[float]]
OptMatrix = Sequence[Sequence[float | None]]


def check_matrix(name: str, m: Sequence[Sequence[Any]], n: int | None) -> int:
    """The size of square matrix ``m`` (``n`` rows where given); ValueError naming ``name``."""
    rows = len(m)
    if rows < 1:
        raise ValueError(f"{name} must have at least one row")
    if n is not None and rows != n:
        raise ValueError(f"{name} has {rows} rows; expected {n}")
    for i, row in enumerate(m):
        if len(row) != rows:
            raise ValueError(f"{name} must be square: row {i} has {len(row)} entries, not {rows}")
    return rows


def check_links(delay_ms: Matrix, bandwidth_mbps: OptMatrix | None
                ) -> tuple[list[list[float]], list[list[float | None]]]:
    """The delay and rate matrices, validated: delays finite and >= 0 (diagonal 0), rates > 0 or
    None for unlimited (``None``, ``inf``, the diagonal or no matrix); at most 253 hosts."""
    n = check_matrix("delay_ms", delay_ms, None)
    if n > 253:
        raise ValueError(f"at most 253 hosts fit in a /24; got {n}")
    delays = [[0.0 if i == j else float(d) for j, d in enumerate(row)]
              for i, row in enumerate(delay_ms)]
    for i, row in enumerate(delays):
        for j, d in enumerate(row):
            if not math.isfinite(d) or d < 0:
                raise ValueError(f"delay_ms[{i}][{j}] must be finite and >= 0; got {d}")
    rates: list[list[float | None]] = [[None] * n for _ in range(n)]
    if bandwidth_mbps is not None:
        check_matrix("bandwidth_mbps", bandwidth_mbps, n)
        for i, row in enumerate(bandwidth_mbps):
            for j, b in enumerate(row):
                if i == j or b is None or b == math.inf:
                    continue
                if not (math.isfinite(float(b)) and float(b) > 0):
                    raise ValueError(f"bandwidth_mbps[{i}][{j}] must be > 0; got {b}")
                rates[i][j] = float(b)
    return delays, rates


class Topology:
    """N hosts in 10.``subnet``.0.0/24, host i in namespace ``dtfm-<token>-<i>`` at
    10.``subnet``.0.(i+1) (or behind a NAT, as ``nat``, ``shared_nat`` and ``firewall`` place
    it), joined by the links ``delays`` and ``rates`` describe (from :func:`check_links`)."""

    def __init__(self, delays: list[list[float]], rates: list[list[float | None]], *,
                 subnet: int, token: str, nat: Sequence[int] = (), firewall: Sequence[int] = (),
                 shared_nat: Sequence[Sequence[int]] = ()) -> None:
        n = len(delays)
        self.subnet = subnet
        self.names = [f"{NAME_PREFIX}{token}-{i}" for i in range(n)]
        self.sites = reach.Sites(reach.layout([f"10.{subnet}.0.{i + 1}" for i in range(n)],
                                              list(nat), list(firewall),
                                              [list(g) for g in shared_nat]))
        self._delay_ms = delays
        self._bandwidth_mbps = rates

    @property
    def size(self) -> int:
        return len(self.names)

    @property
    def delay_ms(self) -> list[list[float]]:
        """One-way delays (row = from, column = to), diagonal 0."""
        return [list(r) for r in self._delay_ms]

    @property
    def bandwidth_mbps(self) -> list[list[float | None]]:
        """Rates in Mbit/s (row = from, column = to); None = unlimited."""
        return [list(r) for r in self._bandwidth_mbps]

    def record_links(self, delay_ms: list[list[float]],
                     bandwidth_mbps: list[list[float | None]]) -> None:
        """What the links are now (after a live change the forwarder confirmed)."""
        self._delay_ms = delay_ms
        self._bandwidth_mbps = bandwidth_mbps

    @property
    def lan(self) -> str:
        """The emulated Internet's /24 (a NATed host's route to its peers' public addresses)."""
        return f"10.{self.subnet}.0.0/24"

    def namespace(self, i: int) -> str:
        """Name of host ``i``'s network namespace."""
        return self.names[self.sites.index(i)]

    def hosts(self) -> list[dict[str, Any]]:
        """Every host: index, namespace, own address, public address, reachability, NAT."""
        return [{"host": i, "namespace": self.names[i], "address": p.address,
                 "public_address": p.public_address, "reachability": p.reachability,
                 "nat": p.site} for i, p in enumerate(self.sites.places)]

    def forwarder_hosts(self) -> list[dict[str, Any]]:
        """The hosts as the forwarder's spec lists them (:mod:`dtfm.wan.emulator`)."""
        return [{"namespace": name, "ifname": DEFAULT_IFNAME, "address": place.address,
                 "reachability": place.reachability, "public_address": place.public_address,
                 "site": place.site}
                for name, place in zip(self.names, self.sites.places, strict=True)]
