"""With two replicas a stage's disagreement names nobody; the coordinator settles it by
placing the two apart, and the agent common to two disputes is excluded (issue 43, R = 2).

Real coordinator and agents on loopback, 2 stages x 2 replicas in `sharded` mode; one agent's
workers scale the gradients they send by 10 from their 8th optimizer step, made bad from
outside the product (tests/agent/worker/badpeer_hook.py through badpeer_site/
sitecustomize.py). The pair check (agent/worker/pairscore.py) reports the disagreement; the
job rolls back before it and re-plans with the two in different stages
(coordinator/integrity/dispute.py); the bad agent disagrees with its new partner too, is
excluded, and the job finishes on the honest three.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from coordinator.integrity.rollback import newest_before
from tests.daemons import Daemons, wait_for

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]
SITE = REPO / "tests" / "agent" / "worker" / "badpeer_site"
ATTACK_AT = 8  # the bad worker's 8th optimizer step (of each epoch's worker) and on
STEPS = 30


def test_a_disputed_pair_is_placed_apart_and_the_agent_common_to_both_disputes_excluded(
        daemons: Daemons) -> None:
    _, address = daemons.coordinator(
        "--model", "gpt-tiny", "--agents", "4", "--min-agents", "2", "--stages", "2",
        "--replicas", "2", "--steps", str(STEPS), "--batch", "8", "--micro-batches", "1",
        "--checkpoint-every", "4", "--search-seconds", "1", "--no-measure",
        "--dp-mode", "sharded", "--verify", "full")
    bad_env = daemons.env(DTFM_TEST_BAD_PEER="*:" + ",".join(
        f"{s}=scale" for s in range(ATTACK_AT, STEPS + 1)),
        PYTHONPATH=os.pathsep.join([str(SITE), str(REPO)]))
    for name in ("agent-0", "agent-1", "agent-2"):
        daemons.agent(address, name)
    daemons.agent(address, "bad", env=bad_env)
    bad = wait_for(lambda: (p := daemons.tmp / "bad" / "agent-id").exists()
                   and p.read_text().strip(), 60, "the bad agent's id")

    done = wait_for(lambda: (j := daemons.status(address)["job"])["state"] in ("done", "failed")
                    and j, 240, "the job to finish", interval=0.5)
    status = daemons.status(address)
    rows = {a["id"]: a for a in status["agents"]}
    assert done["state"] == "done" and done["step"] == STEPS, done
    assert [a for a, r in rows.items() if r["state"] == "excluded"] == [bad], rows
    exclusion = rows[bad]["exclusion"]
    assert exclusion["step"] >= 4, exclusion  # a window before the attack, never earlier
    assert "common to two disagreements" in exclusion["reason"], exclusion
    first, second = done["recoveries"][:2]
    # the dispute: the same four agents, re-planned apart, before anyone is proven bad
    assert "apart" in first["reason"] and bad in first["reason"], first
    assert first["layout_before"] == first["layout_after"] == "2x2", first
    # ... resuming from the newest checkpoint before the dispute's window: the agents moved
    # to the other stage fetched that step, not their new stage's newest
    bound = int(re.search(r"rolling back before step (\d+)", first["reason"]).group(1))
    assert first["resumed_step"] == newest_before(bound, 4) > 0, first
    # the second dispute, with the new partner: excluded, shrunk without it
    assert bad in second["reason"] and "excluded" in second["reason"], second
    assert second["resumed_step"] == newest_before(exclusion["step"], 4), (second, exclusion)
    assert bad not in {a for row in status["plan"]["grid"] for a in row}
