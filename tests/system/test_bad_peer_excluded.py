"""A volunteer that multiplies the gradients it sends by 10 is caught, named, excluded, and what
it touched is rolled back; the job finishes on the honest agents (issue 43).

Real coordinator and agents on loopback; one agent's workers are made bad from outside the
product (tests/agent/worker/badpeer_hook.py through badpeer_site/sitecustomize.py, whatever
rank the coordinator gives it), not by the rehearsal mode. Three replicas of one stage in
`sharded` mode: the two honest owners score the bad copies of their shards, their two
reports confirm the fault (coordinator/integrity/corroborate.py), the agent is excluded, the
job shrinks to two replicas within --min-agents and resumes from a checkpoint before the first
step proven bad.

With two replicas (R = 2), tests/system/test_wan_bad_peer.py: across emulated hosts, the
disagreement settled by placing the pair apart (coordinator/integrity/dispute.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.integrity.rollback import newest_before
from tests.daemons import Daemons
from tests.system.bad_peer_job import run_with_bad_peer

pytestmark = pytest.mark.timeout(300)
ATTACK_AT = 8  # the bad worker's 8th optimizer step and every one after it
STEPS = 30


def excluded_alone_and_rolled_back(daemons: Daemons, attack: str) -> dict[str, Any]:
    """Run the 1 x 3 job with a bad agent that makes `attack` from `ATTACK_AT` on, and check
    what every such run must show: the job done, the bad agent alone excluded, no evidence
    against anyone honest, the job shrunk to 1 x 2 and resumed from the newest checkpoint
    before the first step proven bad (the agents keep every step from the known-good one
    on, vetted 10 steps behind the evidence every member has delivered:
    coordinator/integrity/rollback.py). The bad agent's exclusion."""
    bad, status, rows = run_with_bad_peer(
        daemons, 2, attack, ATTACK_AT, STEPS, "--stages", "1", "--replicas", "3", "--batch", "6")
    done = status["job"]
    assert done["state"] == "done" and done["step"] == STEPS, done
    assert rows[bad]["state"] == "excluded", rows[bad]
    exclusion: dict[str, Any] = rows[bad]["exclusion"]
    assert [a for a, r in rows.items() if r["state"] == "excluded"] == [bad], rows
    honest = [a for a in rows if a != bad]
    assert all(not rows[a].get("evidence") for a in honest), {a: rows[a] for a in honest}
    first = done["recoveries"][0]
    assert first["layout_before"] == "1x3" and first["layout_after"] == "1x2", first
    assert first["resumed_step"] == newest_before(exclusion["step"], 4), (first, exclusion)
    assert bad not in {a for row in status["plan"]["grid"] for a in row}
    return exclusion


def test_a_peer_sending_scaled_gradients_is_excluded_and_the_job_rolls_back(
        daemons: Daemons) -> None:
    exclusion = excluded_alone_and_rolled_back(daemons, "scale")
    assert exclusion["step"] >= ATTACK_AT, exclusion  # nothing before the attack is blamed
    assert exclusion["step"] <= ATTACK_AT + 10, exclusion  # caught within 10 steps


def test_an_owner_sending_back_noised_averages_is_excluded_and_the_job_rolls_back(
        daemons: Daemons) -> None:
    """The bad agent averages its shard honestly and adds noise of one sigma to what it sends
    back (an average: no receiver's statistic can tell it from an honest owner with a bad
    input, agent/worker/avgcheck.py). The replicas' audit of the figures that travel with the
    weights digest (agent/worker/avgaudit.py) finds that its average is not the mean of the
    copies it received; every replica says so, at the digest after the attack's first step."""
    exclusion = excluded_alone_and_rolled_back(daemons, "avg_noise")
    assert exclusion["step"] == ATTACK_AT, exclusion  # exact: the first altered average
    assert "avg_mismatch" in exclusion["reason"], exclusion
