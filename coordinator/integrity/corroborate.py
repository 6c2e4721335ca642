"""When the evidence of agents' replica checks confirms a fault, and against whom.

Why two reporters: a worker's check (coordinator/integrity/reports.py) names a suspect, but
its reporter may be the liar. The threat model (docs/architecture.md, "Integrity") allows at
most one bad agent among a stage's R >= 3 replicas, and every copy of the suspect's gradient
is scored by the owners of the other shards, and every replica compares the weight digests:
so an honest suspect can be named by one liar only, and a bad one is named by at least two
honest agents. One reporter's record is kept as evidence; the same suspect named by
`AGREEING` distinct other agents within `WINDOW_STEPS` steps of one epoch is a confirmed
fault, and the earliest step among the agreeing records is the first step proven bad (the
rollback bound; for a weights digest, the step after the comparison before it:
`dtfm.core.verify.onset`).

Why a statistical kind must persist: `grad_norm` says a copy's norm is 3x the median copy's,
and an honest copy of a hard batch gets there too. A 1000-step honest run (gpt-tiny 2 x 3,
sharded, `--verify full`; docs/architecture.md, "Integrity") named honest ranks by norm 37
times, at isolated steps (ratios up to 6.7), mostly by every replica of the stage at once:
two reporters agreed on 11 (rank, step) pairs, so the one-step rule would have excluded two
honest agents at step 82 and more later. A scaled
copy is scaled at every step it is sent, so for `grad_norm` (and `grad_noise`, a copy's
shape) each agreeing reporter must have named the suspect at `PERSIST_STEPS` distinct steps
within the window (the honest run never
named one rank twice within 10 steps). The kinds with no honest look-alike (zeroed, replayed,
non-finite, drifted weights) confirm at the first agreeing step.

A record that names nobody (R = 2: two replicas disagree and neither can be told right) is
settled elsewhere (coordinator/integrity/dispute.py): the two are placed apart, and a repeat
with a new partner names the agent common to both disputes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from coordinator.integrity.ledger import IntegrityLedger
from coordinator.integrity.reports import EvidenceRecord
from dtfm.core.verify import NORM_DIFFERS, onset

AGREEING = 2  # distinct reporters, none of them the suspect
WINDOW_STEPS = 10  # issue 43: every attack detected within 10 steps of its onset
# Kinds that may confirm a fault. The gradient's direction (grad_cosine) is kept as evidence
# only: two honest owners both read a negative best cosine for the agent that had just joined a
# grown-back job (tests/system/test_churn.py, 2 sequences per replica), and a flipped copy is
# caught by its norm. Its shape (grad_noise: noise of about one sigma flattens a heavy-tailed
# gradient) confirms as a copy's norm does, persisting (below): nothing else catches noise,
# and honest copies reached the shape threshold at isolated steps only (5 pieces of evidence
# in 1000 honest loopback steps of gpt-tiny 2 x 3, 8 across emulated hosts; bench/honest.py,
# honest_wan.py), never one rank at 3 steps within 10.
# Scaled, zeroed, replayed copies and drifted weights have no honest look-alike.
# An owner's averaged shard (agent/worker/avgcheck.py) confirms only when zeroed or replayed,
# which no bad input can cause; its norm, cosine and shape move with a bad contributor's copy
# as much as with a bad owner, and two honest receivers would then name an honest owner.
# A NaN or infinite copy or average (agent/worker/nonfinite.py) confirms: an honest owner
# averages a non-finite copy as zeros, and a replica whose own gradient is not finite names
# nobody (it fails as `config` itself, which outranks its owners' reports).
# The replicas' exact audit of an owner's average (agent/worker/avgaudit.py) confirms: its
# own account not adding up to the average it sent, two contributors' figures against its
# account (or two owners' accounts against a contributor's), two receivers of another
# average. No honest agent produces them, and every replica judges the same figures. So too
# an owner's implied own share, a median over up to 10 exchanges: honest medians <= 1.48
# against 1.65 (an owner that hides what it added to its averages in its own copy: >= 1.81).
# A rank's squared norm that differs from its replicas' (norm_differs, named by the replicas of
# another stage of its pipeline: agent/worker/normtable.py) confirms once its own stage's
# records of the same digest explain nothing (coordinator/integrity/explained.py): with its
# gradient the same as its replicas', no honest rank sends another norm.
CONFIRMING = frozenset({"grad_norm", "grad_noise", "grad_zero", "grad_stale", "weights",
                        "avg_zero", "avg_stale", "grad_nonfinite", "avg_nonfinite",
                        "avg_mismatch", "avg_inputs", "avg_claims", "avg_equivocal",
                        "avg_share", NORM_DIFFERS})
# Kinds whose records relay what one first-hand witness reported: a rank's norm that differs
# (norm_differs) is seen by the replicas of a stage that compare their pipelines' tables, and
# the table that shows it is the odd replica's own row, which a liar writes as it likes. So
# the reporters that agree must be of at least `WITNESS_STAGES` stages: each stage's odd
# replica is another witness of what the suspect sent (with one bad agent, at most one of
# them lies). What one stage alone shows (a two-stage job's only witness, or a rank that sent
# one stage another norm) is a dispute between that stage's odd replica and the rank it
# names (`lone_stage`; explained.py opens it, dispute.py parts them).
WITNESSED = frozenset({NORM_DIFFERS})
WITNESS_STAGES = 2
# Confirming kinds that honest copies reach now and then (a statistical score, not a fact)
PERSISTENT = frozenset({"grad_norm", "grad_noise"})
PERSIST_STEPS = 3  # distinct steps within the window, per reporter, for a PERSISTENT kind
KEPT_STEPS = 4 * (2 * WINDOW_STEPS + 1)  # steps remembered per reporter and suspect
# (record, first bad step, the agreeing reporters) -> whether its confirmation waits
Deferral = Callable[[EvidenceRecord, int, list[str]], bool]


def _near(steps: Iterable[int], step: int) -> int:
    """How many of `steps` lie within the window around `step`."""
    return sum(abs(s - step) <= WINDOW_STEPS for s in steps)


@dataclass
class _Named:
    first: int  # the earliest step this reporter named the suspect at
    stage: int = -1  # the reporter's stage in the epoch's layout (-1: not known)
    sure: deque[int] = field(default_factory=lambda: deque(maxlen=KEPT_STEPS))
    scored: deque[int] = field(default_factory=lambda: deque(maxlen=KEPT_STEPS))

    def note(self, step: int, kind: str, began: int) -> None:
        self.first = min(self.first, began)
        steps = self.scored if kind in PERSISTENT else self.sure
        if step not in steps:
            steps.append(step)

    def agrees_at(self, step: int) -> bool:
        """Whether this reporter's namings near `step` confirm: one of a sure kind, or
        `PERSIST_STEPS` distinct steps of a persistent one."""
        return _near(self.sure, step) >= 1 or _near(self.scored, step) >= PERSIST_STEPS


class Corroboration:
    """Who named whom, in the running epoch (bounded by its members: reporters x suspects)."""

    def __init__(self) -> None:
        self.epoch = -1
        self.sync_every = 1  # the running epoch's H (a digest's onset: `verify.onset`)
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
        began = onset(rec.kind, rec.step, self.sync_every)
        by.setdefault(rec.reporter, _Named(began, rec.stage)).note(rec.step, rec.kind, began)
        recent = self._recent(rec)
        if rec.reporter in recent and len(recent) >= AGREEING and (
                rec.kind not in WITNESSED or len(self._stages(recent)) >= WITNESS_STAGES):
            return True, min(n.first for n in recent.values()), sorted(recent)
        return False, rec.step, []

    def lone_stage(self, rec: EvidenceRecord) -> list[str]:
        """For a `WITNESSED` kind that `agreement` did not confirm: the reporters that agree
        on it, `rec`'s among them, where they are `AGREEING` or more of one stage (a rank's
        norm that one stage's odd replica alone shows: explained.py makes the two a
        dispute); [] otherwise."""
        if rec.kind not in WITNESSED:
            return []
        recent = self._recent(rec)
        if rec.reporter in recent and len(recent) >= AGREEING and \
                len(self._stages(recent)) == 1:
            return sorted(recent)
        return []

    def _recent(self, rec: EvidenceRecord) -> dict[str, _Named]:
        """The reporters whose namings of `rec`'s suspect near its step confirm."""
        return {r: n for r, n in self._named.get(rec.agent_id, {}).items()
                if n.agrees_at(rec.step)}

    @staticmethod
    def _stages(named: dict[str, _Named]) -> set[int]:
        return {n.stage for n in named.values()} - {-1}

    def feed(self, records: Iterable[EvidenceRecord], ledger: IntegrityLedger,
             sync_every: int = 1, defer: Deferral | None = None,
             lone: Deferral | None = None) -> None:
        """Record each new record that names a suspect in `ledger`, confirmed or not
        (`sync_every`: the epoch's H). `defer(rec, first, agreeing)`: True when a
        confirmation must wait for another check (the pipeline links: a suspect fed wrong
        inputs computes wrong gradients, coordinator/integrity/linkwitness.py), which then
        confirms it or finds it explained; it is recorded unconfirmed meanwhile.
        `lone(rec, first, agreeing)`: called for a `WITNESSED` record that one stage's
        reporters agree on (`lone_stage`), which may then become a dispute (explained.py)."""
        self.sync_every = sync_every
        for rec in records:
            if not rec.agent_id:
                continue
            confirmed, first, agreeing = self.agreement(rec)
            if not confirmed and lone is not None and (alone := self.lone_stage(rec)):
                lone(rec, rec.step, alone)
            if confirmed and defer is not None and defer(rec, first, agreeing):
                confirmed, agreeing = False, []
            detail = (f"{rec.detail} (score {rec.score:.3g}, epoch {rec.epoch}"
                      + (", confirmed by a second reporter" if confirmed else "") + ")")
            ledger.record(rec.agent_id, rec.kind, first if confirmed else rec.step, detail,
                          reporter=rec.reporter, confirmed=confirmed, agreeing=agreeing,
                          agreeing_kinds=CONFIRMING)
