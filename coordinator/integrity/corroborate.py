"""When the evidence of agents' replica checks confirms a fault, and against whom.

Why two reporters: a worker's check (coordinator/integrity/reports.py) names a suspect, but
its reporter may be the liar. The threat model (docs/architecture.md, "Integrity") allows at
most one bad agent among a stage's R >= 3 replicas, and every copy of the suspect's gradient
is scored by the owners of the other shards, and every replica compares the weight digests:
so an honest suspect can be named by one liar only, and a bad one is named by at least two
honest agents. One reporter's record is kept as evidence; the same suspect named by
`AGREEING` distinct other agents within `WINDOW_STEPS` steps of one epoch is a confirmed
fault, and the earliest step among the agreeing records is the first step proven bad (the
rollback bound). A record that names nobody (R = 2: two replicas disagree and neither can be
told right) is logged by reports.py only: settling it needs a third party to recompute the
disputed step, which is not built yet (docs/architecture.md, "Known limits").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from coordinator.integrity.ledger import IntegrityLedger
from coordinator.integrity.reports import EvidenceRecord

AGREEING = 2  # distinct reporters, none of them the suspect
WINDOW_STEPS = 10  # issue 43: every attack detected within 10 steps of its onset
# Kinds that may confirm a fault. The gradient's direction and shape (grad_cosine, grad_noise)
# are kept as evidence only: two honest owners both read a negative best cosine for the agent
# that had just joined a grown-back job (tests/system/test_churn.py, 2 sequences per replica),
# and an honest volunteer excluded is worse than a noisy one caught a few steps later by its
# norm. Scaled, zeroed, replayed copies and drifted weights have no honest look-alike.
# An owner's averaged shard (agent/worker/avgcheck.py) confirms only when zeroed or replayed,
# which no bad input can cause; its norm, cosine and shape move with a bad contributor's copy
# as much as with a bad owner, and two honest receivers would then name an honest owner.
# A NaN or infinite copy or average (agent/worker/nonfinite.py) confirms: an honest owner
# averages a non-finite copy as zeros, and a replica whose own gradient is not finite names
# nobody (it fails as `config` itself, which outranks its owners' reports).
CONFIRMING = frozenset({"grad_norm", "grad_zero", "grad_stale", "weights", "avg_zero",
                        "avg_stale", "grad_nonfinite", "avg_nonfinite"})


@dataclass
class _Named:
    first: int  # the earliest step this reporter named the suspect at
    last: int  # the newest


class Corroboration:
    """Who named whom, in the running epoch (bounded by its members: reporters x suspects)."""

    def __init__(self) -> None:
        self.epoch = -1
        self._named: dict[str, dict[str, _Named]] = {}  # suspect -> reporter -> steps

    def weigh(self, rec: EvidenceRecord) -> tuple[bool, int]:
        """Whether `rec` confirms a fault against `rec.agent_id`, and the first bad step."""
        confirmed, first, _ = self.agreement(rec)
        return confirmed, first

    def agreement(self, rec: EvidenceRecord) -> tuple[bool, int, list[str]]:
        """`weigh`, and the reporters that agree (`rec`'s own among them) when it confirms."""
        if rec.epoch != self.epoch:
            self.epoch, self._named = rec.epoch, {}
        if not rec.agent_id or rec.reporter == rec.agent_id or rec.kind not in CONFIRMING:
            return False, rec.step, []
        by = self._named.setdefault(rec.agent_id, {})
        seen = by.get(rec.reporter)
        if seen is None:
            by[rec.reporter] = _Named(rec.step, rec.step)
        else:
            seen.first, seen.last = min(seen.first, rec.step), max(seen.last, rec.step)
        recent = {r: n for r, n in by.items() if abs(n.last - rec.step) <= WINDOW_STEPS}
        if len(recent) >= AGREEING:
            return True, min(n.first for n in recent.values()), sorted(recent)
        return False, rec.step, []

    def feed(self, records: Iterable[EvidenceRecord], ledger: IntegrityLedger) -> None:
        """Record each new record that names a suspect in `ledger`, confirmed or not."""
        for rec in records:
            if not rec.agent_id:
                continue
            confirmed, first, agreeing = self.agreement(rec)
            detail = (f"{rec.detail} (score {rec.score:.3g}, epoch {rec.epoch}"
                      + (", confirmed by a second reporter" if confirmed else "") + ")")
            ledger.record(rec.agent_id, rec.kind, first if confirmed else rec.step, detail,
                          reporter=rec.reporter, confirmed=confirmed, agreeing=agreeing,
                          agreeing_kinds=CONFIRMING)
