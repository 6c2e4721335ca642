"""The evidence ledger: what the coordinator holds against each agent, and who is excluded.

Every integrity check, wherever it runs, ends here: the workers' replica checks (a gradient
copy that disagrees with its stage's others, a weight digest that is the odd one out, a
frame that failed its MAC through a relay) and the coordinator's own checks of what agents
say about the network (a dial result the other dialers contradict, a link figure its other
direction contradicts, a dead link only one end reports). Kept apart from the job's state
machine because the status answer, the metrics, the state directory and the Join handler
read it as much as the job does, and because the checks that feed it live in several
packages.

Public interface (the only one other code calls):

- `IntegrityLedger.record(agent_id, kind, step=0, detail="", *, reporter="coordinator",
  confirmed=False) -> bool`: one piece of evidence against `agent_id` (the suspect). `kind`
  names the check (e.g. "gradient_outlier", "weight_digest", "tampered_frame", "dial_vote",
  "link_figure", "dead_link"); `step` the training step it concerns (0: none); `detail` what
  was seen, in words (clipped); `reporter` who saw it (an agent id, or "coordinator").
  `confirmed=True` marks a confirmed fault: the agent is excluded at once (the first
  confirmed step sets the rollback bound). Returns whether the agent is excluded now.
  The caller decides `confirmed` on the coordinator's side (a majority of a stage's
  replicas agreeing, the coordinator's own recomputation): a flag an agent sets on the wire
  must never be passed through as it is. Unconfirmed evidence is recorded and shown, never
  excludes on its own. Evidence from an agent already excluded is dropped: a caught liar
  does not go on accusing.
- `excluded(agent_id) -> Exclusion | None`, `refusal(agent_id) -> str` (what a refused
  re-join is told, "" when not excluded), `evidence(agent_id) -> list[Evidence]`,
  `exclusions` (agent id -> Exclusion), `admit(agent_id) -> Exclusion | None` (the operator's
  `coordinator admit`: the exclusion lifted, None when there was none).
- `rollback_before`: the first step proven bad by a confirmed fault whose rollback has not
  happened yet (0: none); the job passes it to the next epoch's assignments and clears it
  (`rolled_back`) once that epoch writes a checkpoint of its own.
- `on_change` and `on_exclude` callbacks the owner sets: the job saves its state on every
  change (`to_json`, put back by passing it to the constructor) and re-plans on an exclusion.

Bounded against a flood: at most MAX_EVIDENCE pieces per agent (the newest kept, the count
of the rest kept) and MAX_SUSPECTS agents with evidence (the one with the oldest newest
piece, never an excluded one, is forgotten first); a detail is clipped to MAX_DETAIL chars.
Slow is not wrong: nothing here knows about lateness, and no caller records it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

log = logging.getLogger(__name__)

COORDINATOR = "coordinator"  # the reporter name of the coordinator's own checks
MAX_EVIDENCE = 32  # pieces kept per agent (the newest)
MAX_SUSPECTS = 1024  # agents with evidence kept
MAX_DETAIL = 300  # characters of a detail kept
MAX_KIND = 40


@dataclass
class Evidence:
    kind: str
    step: int
    detail: str
    reporter: str
    at_unix_s: float
    confirmed: bool = False

    def line(self) -> str:
        at = f" at step {self.step}" if self.step else ""
        return f"{self.kind}{at} (by {self.reporter}): {self.detail}"


@dataclass
class Exclusion:
    reason: str
    step: int  # the first step proven bad (0: not a step)
    at_unix_s: float
    evidence: list[Evidence] = field(default_factory=list)  # the confirmed pieces


@dataclass
class _Suspect:
    evidence: list[Evidence] = field(default_factory=list)
    dropped: int = 0  # older pieces no longer kept


class IntegrityLedger:
    """Evidence by agent, exclusions, and the rollback bound; see the module docstring."""

    def __init__(self, saved: Mapping[str, Any] | None = None) -> None:
        self._suspects: dict[str, _Suspect] = {}
        self.exclusions: dict[str, Exclusion] = {}
        self.total_exclusions = 0  # since the job began (a Prometheus counter)
        self.rollback_before = 0
        # counts the faults that set `rollback_before`: an epoch's own checkpoint lifts only
        # the bound it was planned with, not one a fault found during it set to the same step
        self.rollback_serial = 0
        self.on_change: Callable[[], None] = lambda: None
        self.on_exclude: Callable[[str, Exclusion], None] = lambda agent_id, exclusion: None
        if saved:
            self._restore(saved)

    # --- recording ---
    def record(self, agent_id: str, kind: str, step: int = 0, detail: str = "", *,
               reporter: str = COORDINATOR, confirmed: bool = False,
               agreeing: Iterable[str] = (), agreeing_kinds: Collection[str] = ()) -> bool:
        """Keep one piece of evidence against `agent_id`; exclude it on a confirmed fault.
        `agreeing`: the other reporters whose earlier pieces (of `agreeing_kinds`) this
        confirmation rests on; the newest such piece of each is marked confirmed too and goes
        with the exclusion, so that it shows every agent that named the suspect, not only the
        one whose report came last. Returns whether `agent_id` is excluded now."""
        if reporter != COORDINATOR and reporter in self.exclusions:
            log.info("integrity: dropped %s evidence against %s from %s, itself excluded",
                     kind, agent_id, reporter)
            return agent_id in self.exclusions
        piece = Evidence(kind=kind[:MAX_KIND], step=max(int(step), 0),
                         detail=detail[:MAX_DETAIL], reporter=reporter[:MAX_KIND * 4],
                         at_unix_s=time.time(), confirmed=confirmed)
        suspect = self._suspects.setdefault(agent_id, _Suspect())
        backing = []
        if confirmed:
            for other in sorted(set(agreeing) - {reporter}):
                mine = [e for e in suspect.evidence
                        if e.reporter == other and e.kind in agreeing_kinds]
                if mine:
                    mine[-1].confirmed = True
                    backing.append(mine[-1])
        suspect.evidence.append(piece)
        if len(suspect.evidence) > MAX_EVIDENCE:
            suspect.dropped += len(suspect.evidence) - MAX_EVIDENCE
            del suspect.evidence[:-MAX_EVIDENCE]
        self._bound_suspects()
        log.log(logging.WARNING if confirmed else logging.INFO,
                "integrity: %s evidence against agent %s: %s",
                "confirmed" if confirmed else "unconfirmed", agent_id, piece.line())
        if confirmed and agent_id not in self.exclusions:
            self._exclude(agent_id, piece, backing)
        self.on_change()
        return agent_id in self.exclusions

    def _exclude(self, agent_id: str, piece: Evidence, backing: list[Evidence]) -> None:
        exclusion = Exclusion(reason=f"{piece.kind}: {piece.detail}"[:MAX_DETAIL],
                              step=piece.step, at_unix_s=piece.at_unix_s,
                              evidence=[*backing, piece])
        self.exclusions[agent_id] = exclusion
        self.total_exclusions += 1
        if piece.step:
            self.rollback_before = (min(self.rollback_before, piece.step)
                                    if self.rollback_before else piece.step)
            self.rollback_serial += 1
        log.warning("integrity: agent %s excluded from the job: %s (an operator may admit it "
                    "again: coordinator admit %s)", agent_id, exclusion.reason, agent_id)
        self.on_exclude(agent_id, exclusion)

    def _bound_suspects(self) -> None:
        while len(self._suspects) > MAX_SUSPECTS:
            free = [a for a in self._suspects if a not in self.exclusions]
            if not free:
                return
            oldest = min(free, key=lambda a: self._suspects[a].evidence[-1].at_unix_s
                         if self._suspects[a].evidence else 0.0)
            del self._suspects[oldest]

    # --- reading ---
    def excluded(self, agent_id: str) -> Exclusion | None:
        return self.exclusions.get(agent_id)

    def refusal(self, agent_id: str) -> str:
        """What a re-join (or a report) of an excluded agent is told; "" when it is not."""
        exclusion = self.exclusions.get(agent_id)
        if exclusion is None:
            return ""
        at = f" first proven at step {exclusion.step}" if exclusion.step else ""
        return (f"agent {agent_id} is excluded from the job for a confirmed integrity fault"
                f"{at}: {exclusion.reason}; it stays out until an operator runs "
                f"`coordinator admit {agent_id}` (check its GPU and memory first: a faulty "
                f"device computes wrong values without an error)")

    def evidence(self, agent_id: str) -> list[Evidence]:
        suspect = self._suspects.get(agent_id)
        return list(suspect.evidence) if suspect is not None else []

    def suspects(self) -> list[str]:
        """The agents with evidence against them, excluded or not."""
        return list(dict.fromkeys([*self._suspects, *self.exclusions]))

    # --- the operator and the job ---
    def admit(self, agent_id: str) -> Exclusion | None:
        """Lift `agent_id`'s exclusion (its evidence stays on record); None when it had
        none."""
        exclusion = self.exclusions.pop(agent_id, None)
        if exclusion is not None:
            log.warning("integrity: agent %s admitted again by an operator (was excluded: %s)",
                        agent_id, exclusion.reason)
            self.on_change()
        return exclusion

    def rolled_back(self) -> None:
        """The epoch planned with `rollback_before` wrote a checkpoint of its own: every
        stage is back on a timeline before the bad step; later recoveries resume as usual."""
        if self.rollback_before:
            log.info("integrity: rolled back before step %d; the bound is lifted",
                     self.rollback_before)
            self.rollback_before = 0
            self.on_change()

    # --- the state directory ---
    def to_json(self) -> dict[str, Any]:
        return {"suspects": {a: {"evidence": [asdict(e) for e in s.evidence],
                                 "dropped": s.dropped} for a, s in self._suspects.items()},
                "exclusions": {a: asdict(x) for a, x in self.exclusions.items()},
                "total_exclusions": self.total_exclusions,
                "rollback_before": self.rollback_before,
                "rollback_serial": self.rollback_serial}

    def _restore(self, saved: Mapping[str, Any]) -> None:
        try:
            for agent_id, s in dict(saved.get("suspects", {})).items():
                self._suspects[str(agent_id)] = _Suspect(
                    evidence=[Evidence(**e) for e in s.get("evidence", [])][-MAX_EVIDENCE:],
                    dropped=int(s.get("dropped", 0)))
            for agent_id, x in dict(saved.get("exclusions", {})).items():
                self.exclusions[str(agent_id)] = Exclusion(
                    reason=str(x["reason"]), step=int(x["step"]),
                    at_unix_s=float(x["at_unix_s"]),
                    evidence=[Evidence(**e) for e in x.get("evidence", [])])
            self.total_exclusions = int(saved.get("total_exclusions", len(self.exclusions)))
            self.rollback_before = int(saved.get("rollback_before", 0))
            self.rollback_serial = int(saved.get("rollback_serial", 0))
        except (KeyError, TypeError, ValueError) as exc:  # our own file: say so, keep going
            log.error("integrity: the state directory's evidence could not be read (%s); "
                      "starting with what was read", exc)
