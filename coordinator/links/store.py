"""Measured links: the schedule of measurement rounds and the matrices they fill.

Two transfers through the same device in the same direction disturb each other, so the
coordinator rotates: in each of N-1 rounds every device sends to one peer and receives from
another (see `rotation_rounds`).
Matrices are kept by agent id, so agents that come and go do not shift anyone's row.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from protos.dtfm.v1 import common_pb2

if TYPE_CHECKING:
    import numpy as np


def rotation_rounds(ids: Sequence[str]) -> list[list[tuple[str, str]]]:
    """N-1 rounds of directed (sender, receiver) links; round k sends device i to i+k.

    Every directed link appears once, and in each round every device sends on one link and
    receives on another, which the two directions of a full-duplex link carry side by side.
    A link and its reverse share a round only when k = N/2: otherwise the reverse path of
    every transfer carries nothing but that transfer's acknowledgements, which would queue
    behind another transfer's data and slow it down.
    """
    n = len(ids)
    return [[(ids[i], ids[(i + k) % n]) for i in range(n)] for k in range(1, n)]


def in_rotation(ids: Sequence[str], links: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """`links` (between `ids`) in `rotation_rounds` order, without listing all N(N-1): a
    sampled measurement of 1,000 agents probes a hundred links, not a million."""
    n, at = len(ids), {a: i for i, a in enumerate(ids)}
    return sorted(links, key=lambda link: ((at[link[1]] - at[link[0]]) % n, at[link[0]]))


@dataclass
class LinkEntry:
    delay_ms: float
    bandwidth_gbps: float
    reachable: bool
    error: str
    measured_unix_s: float
    # Non-empty: bandwidth_gbps is the probe's estimate, not a settled rate, and how it was
    # made (LinkSample.estimated and estimate_note).
    estimate: str = ""
    # How the figure was had: "" probed from `from` to `to`; REVERSE: copied from the probe
    # of the other direction (`to` cannot be dialled); RELAYED: priced as relayed through the
    # coordinator (neither end can be dialled). coordinator/links/relayed.py sets both.
    # PUNCHED: neither end can be dialled, and `from` measured it on a direct connection
    # hole-punched through both NATs (coordinator/links/punchprobe.py): a direct link.
    path: str = ""
    # The coordinator failed this link itself (an implausible or contradicting report, a
    # silent measurer, one that left): it stays failed, never taken from its reverse.
    judged: bool = False


REVERSE = "reverse"
RELAYED = "relayed"
PUNCHED = "punched"


@dataclass
class LinkStore:
    """Latest measurement of every directed link, keyed by (from, to) agent ids."""

    entries: dict[tuple[str, str], LinkEntry] = field(default_factory=dict)

    def record(self, from_id: str, sample: common_pb2.LinkSample, latency: bool = True,
               bandwidth: bool = True) -> None:
        """Store a sample; a latency-only or bandwidth-only pass keeps the other figure."""
        old = self.entries.get((from_id, sample.peer_id))
        self.entries[(from_id, sample.peer_id)] = LinkEntry(
            delay_ms=sample.delay_ms if latency or old is None else old.delay_ms,
            bandwidth_gbps=(sample.bandwidth_gbps if bandwidth or old is None
                            else old.bandwidth_gbps),
            reachable=sample.reachable and (old is None or old.reachable or latency),
            error=sample.error or (old.error if old is not None and not latency else ""),
            measured_unix_s=sample.measured_unix_s or time.time(),
            estimate=(estimate_of(sample) if bandwidth or old is None else old.estimate),
        )

    def forget(self, agent_ids: Iterable[str]) -> None:
        """Drop every link to or from these (evicted) agents."""
        gone = set(agent_ids)
        if gone:
            self.entries = {k: e for k, e in self.entries.items()
                            if k[0] not in gone and k[1] not in gone}

    def mark_unreachable(self, from_id: str, to_id: str, error: str) -> None:
        self.entries[(from_id, to_id)] = LinkEntry(math.nan, math.nan, False, error, time.time(),
                                                   judged=True)

    def unreachable_agents(self, ids: Iterable[str]) -> list[str]:
        """Agents to leave out of a plan because links to or from them failed. A link that
        failed one way while the other way was probed fine leaves nobody out: both ends can
        be reached, and its one failed probe (a busy peer's transient error, or a lie, kept
        as evidence by `figures.one_sided`) is no reason to hold an agent out of the job for
        minutes; should the pair fail in training, the recovery relays it or places it
        apart (coordinator/job/failedpairs.py)."""
        ids = list(ids)
        members = set(ids)
        failed = [(a, b) for (a, b), e in self.entries.items()
                  if not e.reachable and a in members and b in members
                  and not ((back := self.entries.get((b, a))) is not None and back.reachable)]
        return blame(ids, failed)

    def matrix(self, ids: Sequence[str]) -> common_pb2.LinkMatrix:
        n = len(ids)
        delay = [math.nan] * (n * n)
        bw = [math.nan] * (n * n)
        unreachable = []
        estimated, notes, relayed, punched = [], [], [], []
        for i, a in enumerate(ids):
            delay[i * n + i] = 0.0
            for j, b in enumerate(ids):
                entry = self.entries.get((a, b))
                if i == j or entry is None:
                    continue
                if entry.reachable:
                    delay[i * n + j] = entry.delay_ms
                    bw[i * n + j] = entry.bandwidth_gbps
                    if entry.estimate:
                        estimated.append(f"{a}->{b}")
                        notes.append(entry.estimate)
                    if entry.path == RELAYED:
                        relayed.append(f"{a}->{b}")
                    elif entry.path == PUNCHED:
                        punched.append(f"{a}->{b}")
                else:
                    unreachable.append(f"{a}->{b}")
        return common_pb2.LinkMatrix(
            agent_ids=list(ids), delay_ms=delay, bandwidth_gbps=bw, unreachable=unreachable,
            estimated=estimated, estimate_notes=notes, relayed=relayed, punched=punched)

    def complete_for(self, ids: Sequence[str]) -> bool:
        return all(
            (a, b) in self.entries and self.entries[(a, b)].reachable
            for a in ids for b in ids if a != b
        )


def estimate_of(sample: common_pb2.LinkSample) -> str:
    """What the store keeps of a sample's estimate mark: "" for a settled rate (or none)."""
    if not (sample.reachable and sample.estimated):
        return ""
    return sample.estimate_note or "the probe's estimate, not a settled rate"


def blame(ids: Sequence[str], failed: Iterable[tuple[str, str]]) -> list[str]:
    """Which agents to leave out for these failed (from, to) links, in `ids` order.

    Each failed link blames the side with more failed links, so one dead agent does not
    exclude every live agent that tried to reach it. A tie is never resolved against the end
    that did not report the failure (issue 43: a liar reported its link to an honest agent as
    failed, and the honest agent was left out): a link (a, b) is a's report, so a tie blames
    b only where b reported the link failed too ((b, a) failed: the peer that did not
    answer, as before), else a.
    """
    failed = list(failed)
    reported = set(failed)
    counts: dict[str, int] = {}
    for a, b in failed:
        counts[a] = counts.get(a, 0) + 1
        counts[b] = counts.get(b, 0) + 1
    blamed = {a if counts[a] > counts[b] or (counts[a] == counts[b]
                                             and (b, a) not in reported) else b
              for a, b in failed}
    return [i for i in ids if i in blamed]


def load_links_file(path: str, need_agents: bool = True) -> dict:
    """A matrix file as `coordinator links --json` writes it, checked: delay_ms and
    bandwidth_gbps (diagonal cells may be null) and, where given or needed, one agent id per
    row. Raises ValueError naming the file."""
    import json

    from coordinator.scheduler import Network

    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read link file {path!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"link file {path!r} is not JSON: {e}") from None
    try:
        for key in ("delay_ms", "bandwidth_gbps"):
            rows = obj[key]
            for i, row in enumerate(rows):
                if isinstance(row, list) and i < len(row) and row[i] is None:
                    row[i] = 0.0 if key == "delay_ms" else 1.0
        Network.from_json(obj)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"link file {path!r}: {e}; write one with `coordinator links "
                         f"--json > FILE`") from None
    agents = obj.get("agents")
    if (agents is not None or need_agents) and (
            not isinstance(agents, list) or len(agents) != len(obj["delay_ms"])):
        raise ValueError(f"link file {path!r} must name its agents: an 'agents' list with one "
                         f"id per row")
    return obj


def matrix_arrays(m: common_pb2.LinkMatrix) -> tuple[np.ndarray, np.ndarray]:
    """The matrix's delays (ms) and bandwidths (Gbit/s) as N x N arrays, NaN where unmeasured
    (numpy is imported here: `coordinator status` renders matrices without it)."""
    import numpy as np

    n = len(m.agent_ids)
    return (np.array(m.delay_ms, dtype=float).reshape(n, n),
            np.array(m.bandwidth_gbps, dtype=float).reshape(n, n))


def matrix_to_json(m: common_pb2.LinkMatrix) -> dict:
    """The `--links FILE` format of `coordinator plan`, plus what failed and which
    bandwidths are estimates.

    JSON has no NaN: unmeasured or unreachable cells become null.
    """
    n = len(m.agent_ids)

    def rows(values: Sequence[float]) -> list[list[float | None]]:
        return [
            [None if math.isnan(v) else round(v, 6) for v in values[i * n:(i + 1) * n]]
            for i in range(n)
        ]

    return {
        "agents": list(m.agent_ids),
        "delay_ms": rows(m.delay_ms),
        "bandwidth_gbps": rows(m.bandwidth_gbps),
        "unreachable": list(m.unreachable),
        # "from->to": how its bandwidth was estimated (the probe never settled on a rate)
        "estimated": dict(zip(m.estimated, m.estimate_notes, strict=False)),
        # "from->to" links neither end can dial: priced through the coordinator's relay
        "relayed": list(m.relayed),
        # "from->to" links neither end can dial whose hole punch got through: priced direct
        "punched": list(m.punched),
        "excluded": blame(m.agent_ids, [tuple(p.split("->", 1)) for p in m.unreachable]),
    }
