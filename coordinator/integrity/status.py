"""The ledger as status shows it: on the wire (`AgentStatus.exclusion`, `.evidence`) and in the
`coordinator status --json` document and the web view's JSON (coordinator/daemon/statusjson.py
builds both from here, so they cannot drift).

An excluded agent's row has state `excluded`, with the reason, the first step proven bad and
the evidence that confirmed the fault (the exclusion's own pieces: the reports that keep
arriving after it, confirmed too, would push an agreeing reporter's out of the newest
`SHOWN`, and the exclusion would then name one accuser); every agent with evidence against
it, excluded or not, lists it (newest last, at most `SHOWN` pieces): network lies are shown
this way without excluding.
"""

from __future__ import annotations

from typing import Any

from coordinator.integrity.ledger import Evidence, IntegrityLedger
from protos.dtfm.v1 import common_pb2, coordinator_pb2

SHOWN = 8  # pieces of evidence a status row carries (the newest)


def _evidence(e: Evidence) -> coordinator_pb2.Evidence:
    return coordinator_pb2.Evidence(kind=e.kind, step=e.step, detail=e.detail,
                                    reporter=e.reporter, at_unix_s=e.at_unix_s,
                                    confirmed=e.confirmed)


def integrity_status(row: coordinator_pb2.AgentStatus, ledger: IntegrityLedger
                     ) -> coordinator_pb2.AgentStatus:
    """`row` with its agent's exclusion and evidence filled in (the same message)."""
    agent_id = row.info.agent_id
    if (exclusion := ledger.excluded(agent_id)) is not None:
        row.state = coordinator_pb2.AGENT_STATE_EXCLUDED
        row.exclusion.CopyFrom(coordinator_pb2.Exclusion(
            reason=exclusion.reason, step=exclusion.step, at_unix_s=exclusion.at_unix_s,
            evidence=[_evidence(e) for e in exclusion.evidence]))
    row.evidence.extend(_evidence(e) for e in ledger.evidence(agent_id)[-SHOWN:])
    return row


def excluded_rows(ledger: IntegrityLedger, shown: set[str]) -> list[coordinator_pb2.AgentStatus]:
    """A row for each excluded agent the registry has none of (a restarted coordinator's,
    whose excluded agents never got back in), so status lists every exclusion."""
    return [integrity_status(coordinator_pb2.AgentStatus(
        info=common_pb2.AgentInfo(agent_id=agent_id)), ledger)
        for agent_id in ledger.exclusions if agent_id not in shown]


def evidence_to_json(e: coordinator_pb2.Evidence) -> dict[str, Any]:
    return {"kind": e.kind, "step": e.step, "detail": e.detail, "reporter": e.reporter,
            "at": e.at_unix_s, "confirmed": e.confirmed}


def agent_integrity_json(a: coordinator_pb2.AgentStatus) -> dict[str, Any]:
    """An agent row's integrity keys for `status --json`: `exclusion` (null unless excluded:
    reason, step, at, and the evidence that confirmed it) and `evidence` (every piece shown)."""
    evidence = [evidence_to_json(e) for e in a.evidence]
    exclusion = None
    if a.HasField("exclusion"):
        exclusion = {"reason": a.exclusion.reason, "step": a.exclusion.step,
                     "at": a.exclusion.at_unix_s,
                     "evidence": [evidence_to_json(e) for e in a.exclusion.evidence]}
    return {"exclusion": exclusion, "evidence": evidence}


def integrity_lines(agents: list[dict[str, Any]]) -> list[str]:
    """The text `coordinator status` prints for the agents' integrity: one line per excluded
    agent, one per agent with evidence only (its newest piece)."""
    lines = []
    for a in agents:
        if (x := a.get("exclusion")) is not None:
            at = f" from step {x['step']}" if x["step"] else ""
            lines.append(f"  {a['id']}: EXCLUDED{at}: {x['reason']} "
                         f"(admit again: coordinator admit {a['id']})")
        elif a.get("evidence"):
            e = a["evidence"][-1]
            at = f" at step {e['step']}" if e["step"] else ""
            lines.append(f"  {a['id']}: {len(a['evidence'])} piece(s) of evidence, not "
                         f"excluded; newest: {e['kind']}{at} by {e['reporter']}: "
                         f"{e['detail']}")
    return lines
