"""Live changes to a running emulated WAN: a link's delay or rate, a cut link, a host's speed.

Owns the changes tests and benchmarks script while a WAN runs ("this link degrades at step
40", "cut the link between agents 1 and 2", "host 2 computes 3x slower"): each goes to the
forwarder over its control socket (:class:`dtfm.wan.forwarder_process.ForwarderProcess`),
applies to packets sent from then on, and what the forwarder answers is recorded in the
:class:`dtfm.wan.topology.Topology` (the links) and here (cut links, compute factors), so the
harness reports what the network is now. ``python -m dtfm.wan set`` makes the same changes
from outside.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dtfm.wan.forwarder_process import ForwarderProcess
from dtfm.wan.topology import Topology


class LiveChanges:
    """The changes to one running WAN (``WanEmulator.live``)."""

    def __init__(self, topology: Topology, forwarder: ForwarderProcess) -> None:
        self._topology = topology
        self._forwarder = forwarder
        self._compute: dict[int, float] = {}
        self._cut: set[tuple[int, int]] = set()

    @property
    def cut(self) -> set[tuple[int, int]]:
        """The directed links (src, dst) cut by :meth:`set_link`: they drop every packet."""
        return set(self._cut)

    @property
    def compute(self) -> dict[int, float]:
        """Hosts whose compute was slowed, and by what factor (1: as fast as it is)."""
        return dict(self._compute)

    def compute_file(self, i: int) -> str:
        """The file host ``i``'s compute slowdown factor is written to: start its workers with
        ``DTFM_COMPUTE_SLOWDOWN_FILE`` set to it and :meth:`set_compute` slows them live."""
        return str(self._forwarder.compute_dir / str(self._topology.sites.index(i)))

    def set_link(self, src: int, dst: int, *, delay_ms: float | None = None,
                 bandwidth_mbps: float | None | str = "keep", both_ways: bool = False,
                 cut: bool | None = None) -> None:
        """Change the link src -> dst (and dst -> src with ``both_ways``) while it runs:
        ``delay_ms`` None keeps the delay, ``bandwidth_mbps`` "keep" keeps the rate and None
        lifts the limit; ``cut`` True drops every packet on it (both hosts still reach every
        other host), False carries them again. Applies to packets sent from now on."""
        index = self._topology.sites.index
        change: dict[str, Any] = {"src": index(src), "dst": index(dst)}
        if cut is not None:
            change["cut"] = cut
        if delay_ms is not None:
            change["delay_ms"] = delay_ms
        if bandwidth_mbps != "keep":
            change["bandwidth_mbps"] = bandwidth_mbps
        changes = [change] + ([{**change, "src": change["dst"], "dst": change["src"]}]
                              if both_ways else [])
        self.set_links(changes)

    def set_links(self, changes: Sequence[Mapping[str, Any]]) -> None:
        """Apply several link changes at once (``{"src", "dst", "delay_ms"?,
        "bandwidth_mbps"?, "cut"?}`` each, as the control socket takes them)."""
        self._record(self._forwarder.request({"links": [dict(c) for c in changes]}))

    def set_compute(self, i: int, factor: float) -> None:
        """Make host ``i``'s workers compute ``factor`` times slower from their next step (1:
        back to full speed); they must have been started with ``compute_file(i)``."""
        index = self._topology.sites.index(i)
        self._record(self._forwarder.request({"compute": {str(index): factor}}))

    def forget_nat(self) -> int:
        """Make every NAT drop its mappings (a router reboot); how many it had."""
        answer = self._forwarder.request({"forget_nat": True})
        self._record(answer)
        return int(answer["forgotten"])

    def _record(self, answer: dict[str, Any]) -> None:
        self._topology.record_links(
            [[float(x) for x in row] for row in answer["delay_ms"]],
            [[None if x is None else float(x) for x in row] for row in answer["bandwidth_mbps"]])
        self._compute = {int(h): float(f) for h, f in answer["compute"].items()}
        self._cut = {(int(i), int(j)) for i, j in answer.get("cut", [])}
