"""What a confirmed fault does to the job: the agent is stopped and excluded, the job re-plans
without it, and the next epoch rolls back before the first step proven bad.

The ledger (coordinator/integrity/ledger.py) decides who is excluded; this module carries it
out for one job, reusing what a lost agent already sets off: the registry marks the row
`excluded` (`Registry.exclude`), which tells the job as it tells it of a lost agent
(`Job.on_lost`), so the recovery stops the members and plans again on the live agents, with
a spare or shrunk within `--min-agents` (coordinator/job/membership.py). The excluded row
never counts as alive again: its heartbeats are refused, its re-joins too
(coordinator/daemon/server.py asks `refusal`), until `coordinator admit` lifts it (`admit`).

The rollback (coordinator/integrity/rollback.py): the job's newest checkpoint step drops to
the newest one before the bad step, the next epoch's assignments carry the bound
(`plan_epoch`), and once that epoch writes a checkpoint of its own the bound is lifted
(`checkpointed`). An R = 2 dispute (coordinator/integrity/dispute.py) asks for the same
rollback, and for a re-plan with the two replicas apart, before anyone is proven bad.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from coordinator.daemon.registry import Registry
from coordinator.integrity import dispute, rollback
from coordinator.integrity.explained import HeldConfirmations
from coordinator.integrity.ledger import COORDINATOR, Exclusion, IntegrityLedger
from coordinator.integrity.linkwitness import LinkWitness
from coordinator.integrity.reports import EvidenceRecord
from dtfm.core.verify import AVG_DISAGREE, NORM_DISAGREE
from protos.dtfm.v1 import common_pb2, coordinator_pb2

log = logging.getLogger(__name__)


class Checkpoints(Protocol):
    step: int  # the newest step every member holds a checkpoint of


class JobIntegrity:
    """The ledger of one job and its consequences."""

    def __init__(self, registry: Registry, checkpoints: Checkpoints,
                 saved: Mapping[str, Any] | None = None) -> None:
        """`checkpoints`: the job's (`CheckpointTracker`), whose newest step every member
        holds drops to the one a rollback resumes from."""
        self.registry = registry
        self.checkpoints = checkpoints
        self.job_id = ""  # for the stop command; the job sets it
        self.checkpoint_every = 0
        self.sync_every = 1
        self.planned_bound = 0  # the rollback bound this epoch's assignments carry
        self.planned_serial = 0  # the ledger's `rollback_serial` when it was planned
        # the checkpoint step this epoch started from (None: adopted, not planned here)
        self.epoch_from: int | None = None
        # whether this epoch has replicas to check against each other (R > 1; the screen
        # for non-finite copies runs whatever --verify says): without them no evidence
        # comes, no rollback, and no known-good copy need be kept
        self.checked = True
        self.separable = False  # whether this epoch can part two replicas (dispute.py)
        self.by_spare = False  # ... only by a spare in place of one of them (`Disputes.benched`)
        self.unsettled = ""  # why this epoch cannot settle a dispute (`dispute.unsettled`)
        self.ledger = IntegrityLedger(saved)
        self.ledger.on_exclude = self._exclude
        self.disputes = dispute.restore(saved.get("disputes") if saved else None)
        self.links = LinkWitness()  # both ends of every pipeline link (linkwitness.py)
        self._members: list[str] = []  # the epoch's agents by rank
        self._ranks: dict[str, int] = {}
        # gradient faults that wait for the links' verdict (explained.py): the corroboration's
        # `defer` (coordinator/daemon/server.py passes it)
        self.held = HeldConfirmations(self.links, lambda agent: self._ranks.get(agent),
                                      self._explain_own)
        self.defer = self.held.defer
        self.lone = self.held.part_later  # a norm one stage alone shows: a dispute (explained.py)
        self._vetted = 0  # the step through which every member's records have arrived

    def restore(self, saved: Mapping[str, Any]) -> None:
        """Put back a restarted coordinator's ledger, keeping the callbacks."""
        ledger = IntegrityLedger(saved)
        ledger.on_change, ledger.on_exclude = self.ledger.on_change, self._exclude
        self.ledger = ledger
        self.disputes = dispute.restore(saved.get("disputes") if saved else None)
        # an adopted epoch planned with the bound lifts it at its own checkpoint, as before
        self.planned_bound = int(saved.get("planned_bound", 0)) if saved else 0
        self.planned_serial = int(saved.get("planned_serial", 0)) if saved else 0

    def _exclude(self, agent_id: str, exclusion: Exclusion) -> None:
        if self.registry.get(agent_id) is not None:
            try:  # its worker stops now, not when the recovery stops the members
                self.registry.send(agent_id, coordinator_pb2.Command(
                    stop=coordinator_pb2.StopCommand(
                        job_id=self.job_id, reason=f"excluded: {exclusion.reason}")))
            except KeyError:
                pass
        if bound := self.pending_bound():
            self._roll_back(bound)
        self.registry.exclude(agent_id, f"excluded for a confirmed integrity fault: "
                                        f"{exclusion.reason}")

    def _explain_own(self, rec: EvidenceRecord) -> str:
        """Why a rank's norm that differs from its replicas' (`norm_differs`) is not its lie:
        its own stage disputes an average it got (`avg_disagree`: its gradient, and so its
        norm, differs for that), or a rollback pending from before the step takes the step
        back (the owner of its average named outright, or any fault that moved its
        gradient); "" where nothing does."""
        for d in self.disputes.disputes:
            if d.kind == AVG_DISAGREE and rec.agent_id in d.pair and d.live(rec.step):
                return (f"its own stage disputes the average it got from {d.partner(rec.agent_id)}"
                        f" at step {d.step}")
        if (bound := self.pending_bound()) and bound <= rec.step:
            return f"a rollback to before step {bound} takes the step back"
        return ""

    def _norm_pair(self, rec: EvidenceRecord) -> EvidenceRecord | None:
        """The dispute a rank's norm that one stage alone shows makes (`NORM_DISAGREE`):
        between that rank and its pipeline's replica of the reporters' stage, whose weights
        the digest found odd and whose own table shows the norm. Either made it up: the
        rank sent that stage another norm, or the odd replica drifted and wrote another in
        its table (its row is its own to write). None outside the epoch's layout."""
        rank, stages = self._ranks.get(rec.agent_id), self.links.stages
        if rank is None or stages < 2 or not 0 <= rec.stage < stages or \
                rank % stages == rec.stage:
            return None
        at = (rank // stages) * stages + rec.stage  # rank = replica * stages + stage
        if at >= len(self._members):
            return None
        odd = self._members[at]
        return EvidenceRecord(
            "", NORM_DISAGREE, rec.step,
            f"{rec.detail}; stage {rec.stage}'s replicas alone show it, so {odd} (whose weights "
            f"differ and whose table shows the norm) and {rec.agent_id} disagree",
            COORDINATOR, -1, rec.score, rec.epoch, (odd, rec.agent_id), rec.stage)

    def _roll_back(self, bad_step: int) -> None:
        """The job's newest usable checkpoint is the newest before `bad_step`."""
        self.checkpoints.step = min(self.checkpoints.step, rollback.newest_before(
            bad_step, self.checkpoint_every, self.sync_every))

    def admit(self, agent_id: str) -> str:
        """The operator's `coordinator admit`: what was done, in words; raises KeyError when
        `agent_id` is not excluded."""
        exclusion = self.ledger.admit(agent_id)
        if exclusion is None:
            raise KeyError(agent_id)
        self.registry.admit(agent_id)
        return (f"agent {agent_id} admitted again (was excluded: {exclusion.reason}); it "
                f"takes part once it joins (restart it: an excluded agent's session ends)")

    def refusal(self, agent_id: str) -> str:
        return self.ledger.refusal(agent_id)

    def pending_bound(self) -> int:
        """The step the next epoch must resume before, for a confirmed fault or an R = 2
        dispute (0: none)."""
        return min((b for b in (self.ledger.rollback_before, self.disputes.rollback_before)
                    if b), default=0)

    def settle(self, records: Iterable[EvidenceRecord]) -> bool:
        """Weigh the new records' R = 2 disputes (`dispute.Disputes.feed`); True when the job
        must re-plan (`disputes.replan_reason`)."""
        replan = self.disputes.feed(records, self.ledger, self.sync_every, self.separable,
                                    first_step=(self.epoch_from or 0) + 1,
                                    by_spare=self.by_spare)
        if replan:
            self.ledger.on_change()
        return replan

    def witness(self, agent_id: str, report: coordinator_pb2.ProgressReport) -> bool:
        """Take in a member's pipeline-link windows and weigh what the windows every member
        has reported show (`LinkWitness`); True when the job must re-plan (an R = 2
        dispute: `disputes.replan_reason`). A confirmed fault excludes through the ledger."""
        rank = self._ranks.get(agent_id)
        if rank is None:
            return False
        for w in report.link_windows:
            self.links.add(report.epoch, rank, w.step,
                           (w.act_out, w.act_in, w.grad_out, w.grad_in))
        disputes = []
        for f in self.links.judge():
            agents = [self._members[r] for r in f.suspects]
            if f.kind in dispute.DISPUTING:  # undecided: two replicas' senders, or a link's ends
                disputes.append(EvidenceRecord(
                    "", f.kind, f.step, f.detail, COORDINATOR, -1, f.score, report.epoch,
                    tuple(agents), f.suspects[0] % max(self.links.stages, 1)))
                continue
            for a in agents:
                self.ledger.record(a, f.kind, f.onset if f.confirmed else f.step,
                                   f"{f.detail} (epoch {report.epoch})",
                                   confirmed=f.confirmed)
        # after the links' findings
        for rec in self.held.release(self.ledger, report.step, self._vetted):
            if pair := self._norm_pair(rec):
                disputes.append(pair)
        return self.settle(disputes) if disputes else False

    def plan_epoch(self, assignments: list[common_pb2.Assignment], sync_every: int,
                   separable: bool = False, rows: Sequence[Sequence[str]] = (),
                   by_spare: bool = False, members: Sequence[str] = (),
                   unsettled: str = "") -> None:
        """Carry the pending rollback bound in the next epoch's assignments (`sync_every`:
        the epoch's H, where its checkpoints fall; `separable`: whether its layout and
        placement could part two replicas of a stage, `by_spare`: only by a spare agent in
        place of one; `rows`: its grid, agent ids by stage, which parts the disputed pairs or
        not, `dispute.separate`; `members`: its agents by rank, whose pipeline links
        `witness` checks)."""
        self.sync_every = max(sync_every, 1)
        self.separable, self.by_spare = separable, separable and by_spare
        self.disputes.planned(rows)
        self.planned_bound = self.pending_bound()
        self.planned_serial = self.ledger.rollback_serial
        if self.planned_bound:
            self._roll_back(self.planned_bound)
        for a in assignments:
            a.resume_before = self.planned_bound
        self.epoch_from = self.checkpoints.step
        self.checked = any(a.replicas > 1 for a in assignments)
        said, self.unsettled = self.unsettled, unsettled if self.checked else ""
        if self.unsettled and self.unsettled != said:
            log.warning("integrity: %s", self.unsettled)
        self.held.epoch_ended()
        self._vetted = 0
        self._members = list(members)
        self._ranks = {a: r for r, a in enumerate(self._members)}
        if assignments:
            first = assignments[0]
            self.links.plan(first.epoch, first.stages, first.replicas,
                            judge_gains=not first.train.pipeline_delay)

    def checkpointed(self) -> None:
        """Every member passed a checkpoint this epoch wrote: an epoch planned with the
        rollback bound has its own, clean checkpoint now."""
        if (self.planned_bound and self.ledger.rollback_before
                and self.planned_serial == self.ledger.rollback_serial):
            self.ledger.rolled_back()  # no fault found since it was planned
        if self.planned_bound:
            self.disputes.rolled_back()
        self.planned_bound = 0

    def keep_floor(self, floor: int, members: Iterable[tuple[int, int] | None]) -> int:
        """The agents' keep floor with the known-good checkpoint (`rollback.keep_floor`), vetted
        by the members' (step, integrity_through) (`rollback.vetted_step`)."""
        if not self.checked:
            return floor
        epoch_from = self.checkpoints.step if self.epoch_from is None else self.epoch_from
        self._vetted = rollback.vetted_step(members, epoch_from)
        kept = rollback.keep_floor(floor, self._vetted,
                                   self.checkpoint_every, self.sync_every,
                                   self.pending_bound())
        if kept and (first := self.held.earliest()):  # a fault waiting for the links' verdict
            kept = min(kept, rollback.newest_before(first, self.checkpoint_every,
                                                    self.sync_every) or 1)
        return kept

    def to_json(self) -> dict[str, Any]:
        return {**self.ledger.to_json(), "planned_bound": self.planned_bound,
                "planned_serial": self.planned_serial,
                "disputes": self.disputes.to_json()}
