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
from dtfm.core.verify import onset
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
    assert done["state"] == "done" and done["step"] == STEPS, (
        done["state"], done["message"], done.get("recoveries"))
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


def pipelined_excluded_alone(daemons: Daemons, attack: str, kind: str, stages: int = 2,
                             first_bad: int = ATTACK_AT
                             ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run a `stages` x 3 job (scheduled placement: a swap parts a disputed pair) with a bad
    agent that makes `attack` from `ATTACK_AT` on, and check that the job finished, the bad
    agent alone was excluded, for `kind` at `first_bad` (the first step proven bad), and
    nothing is confirmed against an honest agent. The finished job and the exclusion."""
    bad, status, rows = run_with_bad_peer(
        daemons, 3 * stages - 1, attack, ATTACK_AT, STEPS, "--stages", str(stages),
        "--replicas", "3", "--batch", "6", "--layer-split", "even")
    done = status["job"]
    assert done["state"] == "done" and done["step"] == STEPS, (
        done["state"], done["message"], done.get("recoveries"))
    excluded = [a for a, r in rows.items() if r["state"] == "excluded"]
    assert excluded == [bad], {a: (r["state"], r.get("exclusion")) for a, r in rows.items()}
    exclusion: dict[str, Any] = rows[bad]["exclusion"]
    assert exclusion["reason"].startswith(kind), exclusion
    assert exclusion["step"] == first_bad, exclusion
    for agent, row in rows.items():
        if agent != bad:
            assert not [e for e in row.get("evidence", []) if e["confirmed"]], row
            assert {e["kind"] for e in row.get("evidence", [])}.isdisjoint({"weights"}), row
    return done, exclusion


def test_an_owner_that_sends_one_receiver_another_average_is_excluded_not_the_receiver(
        daemons: Daemons) -> None:
    """The bad agent averages its shard honestly and steps with that, but sends its first
    receiver ten times it (`avg_one`): that receiver's weights alone differ at the next
    digest, and the digest alone would exclude it, the honest one. The audit shows that the
    receiver got another average than its owner accounts for, which either may have made up,
    so the two are a dispute (`avg_disagree`): parted into different stages (two stages of
    three replicas, scheduled placement) and rolled back before the first such exchange.
    The owner does it again to its new stage's receiver, and is the agent common to two
    disputes: excluded, the job rolled back and finished; no honest agent excluded. Nor
    confirmed against: each receiver's pipeline partner, whose weights differed for the norm
    the receiver sent it, is not named for it, and the receiver's norm is explained by its
    stage's dispute (agent/worker/normtable.py, coordinator/integrity/explained.py)."""
    done, exclusion = pipelined_excluded_alone(daemons, "avg_one", "avg_disagree")
    assert "common to two disagreements" in exclusion["reason"], exclusion
    first = done["recoveries"][0]  # the dispute's: parted, rolled back before its exchange
    assert "avg_disagree" in first["reason"] and "apart" in first["reason"], first
    assert first["resumed_step"] == newest_before(ATTACK_AT, 4), first


def test_a_rank_lying_about_its_gradient_norm_is_excluded_not_its_pipeline_partner(
        daemons: Daemons) -> None:
    """The bad agent sends its pipeline 100x its squared gradient norm and clips with its own
    (`norm_lie`): its pipeline partner clips with another coefficient, and its weights alone
    differ from its replicas' at the next digest, which named it, the honest one. The
    pipelines' norms travel with the digest (agent/worker/normtable.py): the partner's
    replicas name the bad agent for the norm it sent (`norm_differs`). Three stages: the
    bad agent's two partners are two witnesses of what it sent (one stage's records relay
    one table, the odd replica's own, which a liar could write: coordinator/integrity/
    corroborate.py), and its own stage's records explain nothing (no average it got
    disputed), so it is excluded, rolled back before the first such step; no honest agent is
    excluded or confirmed against."""
    done, _ = pipelined_excluded_alone(daemons, "norm_lie", "norm_differs", stages=3)
    first = done["recoveries"][0]
    assert first["resumed_step"] == newest_before(ATTACK_AT, 4), first


def test_a_rank_lying_about_its_norm_in_two_stages_is_excluded_by_two_disputes(
        daemons: Daemons) -> None:
    """As above in a pipeline of two stages, where one stage alone sees the norm: its odd
    replica's table, which that replica writes itself, is the only witness, so the odd
    replica and the bad agent are a dispute (`norm_disagree`, coordinator/integrity/
    explained.py), parted into different pipelines and rolled back before the digest's
    window (the odd replica's word dates the norm: verify.onset). The bad agent lies to its
    new pipeline too and is the agent common to two disputes: excluded; nobody honest is."""
    done, exclusion = pipelined_excluded_alone(daemons, "norm_lie", "norm_disagree",
                                               first_bad=onset("norm_disagree", ATTACK_AT))
    assert "common to two disagreements" in exclusion["reason"], exclusion
    first = done["recoveries"][0]
    assert "norm_disagree" in first["reason"] and "apart" in first["reason"], first


def test_a_drifted_rank_that_forges_its_norm_table_is_excluded_not_its_partner(
        daemons: Daemons) -> None:
    """The bad agent's weights drift, and it writes another norm of its pipeline partner in
    its own norm table (`norm_forge`), the row its stage's digest compares: its replicas
    read its weights as differing for its partner's norm, and named nobody for `weights`;
    one stage's records never confirm, so it escaped. Now the odd one and the partner it
    blames are a dispute (`norm_disagree`), parted into different pipelines; it forges again
    beside its new partner and is the agent common to two disputes: excluded, nobody honest
    is."""
    done, exclusion = pipelined_excluded_alone(daemons, "norm_forge", "norm_disagree",
                                               first_bad=onset("norm_disagree", ATTACK_AT))
    assert "common to two disagreements" in exclusion["reason"], exclusion
