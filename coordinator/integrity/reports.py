"""The integrity evidence agents report, turned from worker ranks into agents.

Owns reading `ProgressReport.integrity` (`dtfm.v1.IntegrityEvidence`, what a worker's replica
checks found: agent/worker/replicacheck.py) into plain records that name agents, not ranks:
a worker names a suspect by its rank in the epoch's layout, and only the coordinator knows
which agent held that rank (`JobMachine.members`, in rank order). It keeps each distinct
record once (a heartbeat whose acknowledgement was lost is sent again with the same
records), logs it, and hands back the new ones; it judges nothing. Weighing the evidence,
excluding an agent and rolling back belong to the ledger that consumes these records.

A record is evidence, not a verdict: the reporter may itself be the liar. With R = 2 a
disagreement names nobody (`agent_id` ""), and `candidates` lists both replicas' agents:
the job settles it by placing the two apart, each with a new partner
(coordinator/integrity/dispute.py). So does a record of a kind in
`dtfm.core.verify.REPORTER_PAIRS` (a receiver and the owner of the average it got, at any
R): its candidates are its reporter and the replica of the reporter's stage it names.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dtfm.core.verify import REPORTER_PAIRS

log = logging.getLogger(__name__)

MAX_RECORDS = 4096  # distinct records kept per coordinator (oldest dropped first)


@dataclass(frozen=True)
class EvidenceRecord:
    """One failed replica check, with agents for ranks."""

    agent_id: str  # the suspect's agent; "" when the check could not decide (R = 2)
    kind: str  # as the worker reported it (IntegrityEvidence.kind)
    step: int
    detail: str
    reporter: str  # the agent whose worker ran the check
    suspect_rank: int  # the rank as reported (-1: undecided)
    score: float
    epoch: int
    candidates: tuple[str, ...]  # the agents it may be: the suspect, or the whole dp group
    stage: int = -1  # the reporter's stage in the epoch's layout (-1: not known)


class IntegrityReports:
    """The distinct evidence records heard so far (all jobs; the job id is in no record:
    one coordinator runs one job)."""

    def __init__(self, limit: int = MAX_RECORDS) -> None:
        self.limit = limit
        self._seen: dict[tuple[Any, ...], EvidenceRecord] = {}

    def record(self, reporter: str, report: Any, members: Sequence[str],
               stages: int) -> list[EvidenceRecord]:
        """The new records in `report` (a validated `dtfm.v1.ProgressReport` of the running
        epoch, whose layout has `stages` stages and whose agents by rank are `members`)."""
        new: list[EvidenceRecord] = []
        for e in report.integrity:
            key = (report.epoch, reporter, e.reporter_rank, e.step, e.kind, e.suspect_rank)
            if key in self._seen:
                continue
            if e.step > report.step + 1:  # a check of its step runs before the step's progress
                log.warning("integrity evidence from agent %s dropped: it concerns step %d, "
                            "and the agent's worker reports step %d (a record of a step it has "
                            "not trained is its own error, or a lie)", reporter, e.step,
                            report.step)
                continue
            rec = to_record(reporter, report.epoch, e, members, stages)
            self._seen[key] = rec
            new.append(rec)
            # INFO where it names a suspect: the ledger logs it again, and warns when it is
            # confirmed (an honest 1000-step job reports ~110 unconfirmed records, mostly
            # averages' and norms' statistics, bench/honest.py); a disagreement that names
            # nobody (R = 2) is logged here only
            log.log(logging.INFO if rec.agent_id else logging.WARNING,
                    "integrity evidence from agent %s (rank %d) at step %d: %s names %s: %s",
                    reporter, e.reporter_rank, e.step, e.kind,
                    rec.agent_id or f"nobody yet (one of {', '.join(rec.candidates)})",
                    e.detail)
        while len(self._seen) > self.limit:
            del self._seen[next(iter(self._seen))]
        return new

    def records(self) -> list[EvidenceRecord]:
        """Every distinct record kept, oldest first."""
        return list(self._seen.values())


def to_record(reporter: str, epoch: int, e: Any, members: Sequence[str],
              stages: int) -> EvidenceRecord:
    """One `IntegrityEvidence` as a record (ranks outside `members` map to "")."""
    def agent(rank: int) -> str:
        return members[rank] if 0 <= rank < len(members) else ""

    stage = e.reporter_rank % stages if stages > 0 and 0 <= e.reporter_rank < len(members) \
        else -1  # rank = replica * stages + stage
    suspect = agent(e.suspect_rank)
    candidates: tuple[str, ...] = ()
    if e.kind in REPORTER_PAIRS:  # a dispute of the reporter's own, with a replica of its stage
        if (stage >= 0 and members[e.reporter_rank] == reporter
                and suspect not in ("", reporter) and e.suspect_rank % stages == stage):
            candidates = (reporter, suspect)
        suspect = ""  # a pair names nobody alone
    elif e.suspect_rank >= 0:
        candidates = (suspect,)
    elif stage >= 0:
        candidates = tuple(members[r] for r in range(stage, len(members), stages))
    return EvidenceRecord(suspect, e.kind, int(e.step), e.detail, reporter, int(e.suspect_rank),
                          float(e.score), int(epoch), candidates, stage)
