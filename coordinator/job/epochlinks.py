"""The links an epoch plans on, and what to do about links that carry nothing.

A collaborator of the state machine (`job/machine.py`), kept apart because choosing the
figures is its own decision with three sources: the `--links` file, the store when the same
agents were measured before (a recovery after someone else died: their links did not change),
or a measurement. After workers' peer errors the links those errors blame are measured again
(`suspects`), with every pair's latency (a dead link's pings time out), and the result is
sorted by `links/failure.py` into agents that reach too few peers (left out) and dead links
between agents that are otherwise fine (priced as unusable, so the search avoids them). A grid
that still crosses a dead link (a fixed placement, a kept grid, a connection the cost model
does not price) is swapped off it, or one end is left out (`avoid_dead_links`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from coordinator.daemon.config import JobConfig
from coordinator.daemon.registry import AgentRecord
from coordinator.job.epochplan import EpochPlanner
from coordinator.job.membership import Membership
from coordinator.links import failure as linkfailure
from coordinator.links.measure import LinkMeasurer
from coordinator.links.store import LinkStore, blame, matrix_arrays
from coordinator.scheduler.placement import Placement
from protos.dtfm.v1 import coordinator_pb2

S = coordinator_pb2
# Above this many members a job's measurement is sampled (coordinator/links/infer.py): every
# pair is pinged, but bandwidth is probed for representatives of latency clusters only. All
# pairs' bandwidth is N(N-1) probes, each device in one at a time: 132 s for 64 simulated
# agents (bench/scale.py), hours for 1,000, where sampling probes a few per pair of sites.
SAMPLED_ABOVE = 16


@dataclass
class EpochLinks:
    """The matrices an epoch plans on, and the dead links among its members."""

    delay: np.ndarray
    bandwidth: np.ndarray
    failures: linkfailure.LinkFailures = field(default_factory=linkfailure.LinkFailures)


@dataclass(frozen=True)
class NoLinks:
    """Why the epoch cannot be planned now: the job goes to `state` with `message`, after
    leaving out `hold_out` (agents the others cannot reach)."""

    state: int
    message: str
    hold_out: list[str] = field(default_factory=list)


class EpochLinkSource:
    """Chooses, measures and checks the links of each epoch's members."""

    def __init__(self, config: JobConfig, measurer: LinkMeasurer, links: LinkStore,
                 planner: EpochPlanner, membership: Membership) -> None:
        self.config, self.measurer, self.links = config, measurer, links
        self.planner, self.membership = planner, membership
        # links a peer error blamed: the next epoch re-measures them
        self.suspects: set[tuple[str, str]] = set()

    def blame_peer_errors(self, grid_ids: list[list[str]], failed: list[str]) -> None:
        """Workers of `failed` agents reported peer errors: suspect every link they open."""
        self.suspects = linkfailure.blamed_links(grid_ids, failed)

    async def gather(self, members: Sequence[AgentRecord], epoch: int,
                     announce: Callable[[int, str], None]) -> EpochLinks | NoLinks:
        """The links to plan `members` on; `announce(state, message)` says what it does."""
        cfg = self.config
        wanted = len(members)
        ids = [m.agent_id for m in members]
        suspects = {link for link in self.suspects if set(link) <= set(ids)}
        self.suspects = set()
        self.planner.relayed = []
        if cfg.links_file:
            try:
                return EpochLinks(*self.planner.known_links(ids))
            except ValueError as exc:
                return NoLinks(S.JOB_STATE_FAILED, str(exc))
        if not (cfg.measure_links and wanted > 1):
            return EpochLinks(np.ones((wanted, wanted)), np.ones((wanted, wanted)))
        if epoch and self.links.complete_for(ids) and not suspects:
            # a recovery among agents measured before: their links did not change because
            # someone else died, and measuring again would cost a minute of stall
            matrix = self.links.matrix(ids)
            self.planner.relayed = list(matrix.relayed)
            return EpochLinks(*matrix_arrays(matrix))
        self.membership.cancel_spare_measurement()
        # a recovery measures only the links it has no figure for (newcomers', and those
        # that failed): the others did not change because an agent came or went; after
        # peer errors, also the links they blame (and every pair's latency: a dead link's
        # pings time out)
        if suspects:
            announce(S.JOB_STATE_MEASURING, f"re-measuring {len(suspects)} links the "
                     f"workers' peer errors blame, and every pair's latency")
            matrix = await self.measurer.measure(members, bandwidth_links=suspects)
        else:
            missing = len(self.measurer.missing_links(ids)) if epoch else wanted * (wanted - 1)
            sampled = wanted > SAMPLED_ABOVE
            announce(S.JOB_STATE_MEASURING, f"measuring {missing} links" + (
                " (bandwidth sampled per pair of latency clusters)" if sampled else ""))
            matrix = await self.measurer.measure(members, only_missing=bool(epoch),
                                                 sampled=sampled)
        self.planner.relayed = list(matrix.relayed)  # priced per grid by the planner
        failures = linkfailure.partition(ids, linkfailure.failed_links(self.links, ids))
        if bad := failures.leave_out:
            return NoLinks(S.JOB_STATE_WAITING, f"leaving out unreachable agent(s) "
                           f"{', '.join(bad)}; waiting for others", list(bad))
        return EpochLinks(*linkfailure.priced(*matrix_arrays(matrix), ids, failures.dead),
                          failures)


def avoid_dead_links(found: dict[str, Any], failures: linkfailure.LinkFailures,
                     ids: list[str], placement: Placement) -> list[list[int]] | NoLinks | None:
    """None when `found`'s grid crosses no dead link; else a grid swapped off them (a
    scheduled placement), or, where no swap avoids them or the placement is fixed, which end
    of each crossed link to leave out."""
    dead = failures.indices(ids)
    if not (crossed := linkfailure.crossing(found["grid"], dead)):
        return None
    grid = linkfailure.avoid(found["grid"], dead) if placement.kind == "scheduled" else None
    if grid is not None:
        return grid
    bad = blame(ids, [failures.reported_way(ids[a], ids[b]) for a, b in map(sorted, crossed)])
    return NoLinks(S.JOB_STATE_WAITING, f"no {placement.label} placement avoids the dead "
                   f"link(s) {linkfailure.describe(failures.dead)}: leaving out "
                   f"{', '.join(bad)}; waiting for others", bad)
