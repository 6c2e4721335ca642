"""Membership: which live agents a job can use, and when to grow back onto more.

The job's state machine (`coordinator/job/machine.py`) asks it for the agents it may plan on
(`reachable`, leaving out those the others could not reach: `hold_out`), which of them to
prefer (`prefer_previous`: the last epoch's, who hold their stages' checkpoints), which live
agents are spares (`spares`), and at a fresh checkpoint whether enough have come back to
grow (`grow_reason`). Before an epoch is planned on them it waits for their reachability
verdicts (`with_verdicts`): the data plane (gloo or dtfm), which members serve checkpoint
copies and how links are priced all follow from them. While the job trains it measures
newcomers' links in the background (`measure_spares`), so that a recovery or a grow-back
does not stall for a measurement. A lost agent itself is the registry's news
(`coordinator/daemon/registry.py`); the job turns it into a recovery
(`Job.on_lost`, `Job._recover`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection

from coordinator.daemon.config import JobConfig
from coordinator.daemon.registry import AgentRecord, Registry
from coordinator.daemon.share import by_address
from coordinator.job.epochplan import EpochPlanner
from coordinator.links.measure import LinkMeasurer
from coordinator.links.reachability import ReachChecker
from coordinator.links.store import LinkStore
from coordinator.scheduler.placement import Placement

log = logging.getLogger(__name__)

UNREACHABLE_HOLD_S = 600.0  # how long an agent its peers could not reach is left out
# a spare whose links failed in a background measurement is not probed again before this
SPARE_REMEASURE_S = 60.0
VERDICT_SLACK_S = 1.0  # waited for reachability verdicts beyond the checker's own bound


class Membership:
    """The live agents as the job sees them: usable, held out, spare."""

    def __init__(self, config: JobConfig, registry: Registry, measurer: LinkMeasurer,
                 links: LinkStore, reach: ReachChecker | None = None) -> None:
        self.config = config
        self.reach = reach  # the dial-back checks (None: nobody checks, as in unit tests)
        self.registry = registry
        self.measurer = measurer
        self.links = links
        self.job_id = ""  # for the log; the job sets it
        # agents the others could not reach, left out until they re-join or the time passes:
        # their heartbeats still arrive, and measuring them again would loop forever
        self.unreachable: dict[str, float] = {}
        self._spare_task: asyncio.Task[None] | None = None  # measuring newcomers' links
        self._spare_retry_at = 0.0

    def rejoined(self, agent_id: str) -> None:
        """A re-join may come with a corrected --advertise: measure it again."""
        self.unreachable.pop(agent_id, None)

    def reachable(self) -> list[AgentRecord]:
        """The live agents not held out as unreachable."""
        now = time.monotonic()
        return [a for a in self.registry.alive()
                if self.unreachable.get(a.agent_id, 0.0) <= now]

    def pick(self, placement: Placement, planner: EpochPlanner, settle_after: float,
             moving: list[str], benched: Collection[str] = ()
             ) -> tuple[list[AgentRecord] | None, str, list[AgentRecord]]:
        """The agents the next epoch plans on, if enough are alive: the pinned plan's, or
        `--agents` live ones (fewer when a shrunk layout fits them), in address order, the
        order a network-blind launcher would use, the last epoch's first (`prefer_previous`),
        `benched` ones last (an R = 2 dispute's agent that a spare replaces where one is free:
        coordinator/integrity/dispute.py). Only agents heard from since `settle_after` count.
        Returns (the agents or None, what the job waits for, the agents alive now)."""
        wanted = self.config.agents
        pinned = placement.pinned.agents if placement.pinned is not None else []
        everyone = self.reachable()
        alive = [a for a in everyone if a.last_seen >= settle_after]
        if pinned:
            by_id = {a.agent_id: a for a in alive}
            missing = [a for a in pinned if a not in by_id]
            if not missing:
                return [by_id[a] for a in pinned], "", alive
            what = f"the pinned plan's agents: {len(missing)} of {wanted} not alive " \
                   f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
        else:
            ordered = by_address(alive)
            def first(count: int) -> list[AgentRecord]:
                kept = self.prefer_previous(ordered, count, planner.grid_ids, moving)
                kept = ([a for a in kept if a.agent_id not in benched]
                        + [a for a in kept if a.agent_id in benched])
                return kept[:count]

            if len(alive) >= wanted:
                return first(wanted), "", alive
            fewer = planner.shrink_to(alive)
            if fewer and len(everyone) == len(alive):
                return first(fewer), "", alive
            what = f"agents: {len(alive)} of {wanted} alive" + (
                f" (--min-agents {self.config.min_agents})" if self.config.min_agents
                else "")
            if alive and not fewer and len(alive) >= (self.config.min_agents or wanted):
                what += "; no smaller layout fits their memory"
        return None, what, alive

    async def with_verdicts(self, records: list[AgentRecord],
                            bound_s: float | None = None) -> list[AgentRecord]:
        """`records`, once every one's reachability check has settled, and every dial of
        them a later newcomer was asked for (the first agent of a NAT'd site is reachable
        from its neighbour only once that one joined and got through).

        A newcomer's dial-back ends only at its timeout when nobody can dial it (behind a
        NAT: ~3 s), and a job that starts as soon as enough agents joined would otherwise
        plan on "not checked yet": gloo, which cannot reach that agent, and the epoch fails.
        Bounded by the checker's longest check and `VERDICT_SLACK_S` (or `bound_s`); one
        still unsettled then is planned on as it stands (not checked: it dials out on dtfm,
        is taken as reachable by gloo), with a note in the log."""
        if self.reach is None or not (pending := self.reach.checking(
                [r.agent_id for r in records])):
            return records
        bound = self.reach.longest_check_s + VERDICT_SLACK_S if bound_s is None else bound_s
        log.info("job %s: waiting up to %.1f s for the reachability verdict of %s before "
                 "planning", self.job_id, bound, ", ".join(pending))
        if late := await self.reach.settled(pending, bound):
            log.warning("job %s: no reachability verdict for %s after %.1f s; planning on "
                        "them as not checked (gloo takes them as reachable)", self.job_id,
                        ", ".join(late), bound)
        return records

    def hold_out(self, bad: list[str]) -> None:
        """Leave out agents the others cannot reach until they re-join or the time passes."""
        for agent_id in bad:  # the registry logs it and tells whoever listens
            self.unreachable[agent_id] = time.monotonic() + UNREACHABLE_HOLD_S
            self.registry.mark_lost(agent_id, "unreachable from the other agents "
                                    "when the job measured its links; left out for "
                                    f"{UNREACHABLE_HOLD_S:.0f} s or until it re-joins "
                                    "(check its --advertise address and firewall)")

    def spares(self, members: list[str]) -> list[AgentRecord]:
        """Live agents outside the job that a recovery or a grow-back could use."""
        now, inside = time.monotonic(), set(members)
        return [a for a in self.registry.alive() if a.agent_id not in inside
                and self.unreachable.get(a.agent_id, 0.0) <= now]

    def measure_spares(self, members: list[str], poke: Callable[[], None]) -> None:
        """While the job trains, measure the links of agents that joined since it was
        planned (to and from every member and spare, nothing else), so that growing back, or
        replacing a lost member, reuses stored links instead of stalling for a measurement."""
        cfg = self.config
        if (not cfg.measure_links or cfg.links_file or self.measurer.running
                or (self._spare_task is not None and not self._spare_task.done())
                or time.monotonic() < self._spare_retry_at):
            return
        spares = self.spares(members)
        ids = members + [a.agent_id for a in spares]
        if not spares or not self.measurer.missing_links(ids):
            return
        records = [r for a in members if (r := self.registry.get(a)) is not None]

        async def measure() -> None:
            await self.measurer.measure(records + spares, only_missing=True)
            if bad := self.links.unreachable_agents(ids):
                self.hold_out([a for a in bad if a not in members])
            poke()

        log.info("job %s: measuring the links of %d new agent(s) while training",
                 self.job_id, len(spares))
        self._spare_retry_at = time.monotonic() + SPARE_REMEASURE_S  # a failed link waits
        self._spare_task = asyncio.get_running_loop().create_task(measure())

    def cancel_spare_measurement(self) -> None:
        if self._spare_task is not None and not self._spare_task.done():
            self._spare_task.cancel()
        self._spare_task = None

    @staticmethod
    def prefer_previous(ordered: list[AgentRecord], count: int, grid_ids: list[list[str]],
                        moving: list[str]) -> list[AgentRecord]:
        """Agents of the last epoch (`grid_ids`) first, as many per stage as the new layout
        has replicas: they hold their stage's checkpoints, so keeping them where they were
        costs no copy. A re-plan's move (coordinator/job/replan.py) picks its own
        (`moving`), a spare perhaps among them."""
        by_id = {a.agent_id: a for a in ordered}
        if moving and all(a in by_id for a in moving):
            return [by_id[a] for a in moving] + [a for a in ordered if a.agent_id not in moving]
        if not grid_ids:
            return ordered
        per_stage = max(count // len(grid_ids), 1)
        picked = [by_id[a] for row in grid_ids
                  for a in [x for x in row if x in by_id][:per_stage]]
        return picked + [a for a in ordered if a not in picked]

    def grow_reason(self, members: list[str], planner: EpochPlanner,
                    checkpoint_step: int) -> str:
        """Why to stop at this checkpoint and re-plan on more agents ('' to go on)."""
        if planner.wanted is None or planner.layout is None or planner.layout == planner.wanted:
            return ""
        spare = self.spares(members)
        if self.config.measure_links and not self.config.links_file:
            # only newcomers already measured in the background: growing waits for them
            # instead of stalling every member for a measurement
            spare = [a for a in spare
                     if self.links.complete_for(members + [a.agent_id])]
        total = len(members) + len(spare)
        wanted = planner.wanted.stages * planner.wanted.replicas
        target = wanted if total >= wanted else planner.shrink_to(
            [r for a in members if (r := self.registry.get(a)) is not None] + spare)
        if target <= len(members):
            return ""
        return (f"{len(spare)} more agent(s) alive: growing back from {planner.layout_text()} "
                f"at the checkpoint of step {checkpoint_step}")
