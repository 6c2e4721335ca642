"""A volunteer whose device scales or zeroes the pipeline messages it sends is caught from both
ends of its links and named; no honest agent is excluded for what flowed from it (issue 43,
item 3). Scaled or zeroed activations, and zeroed gradients, exclude it and roll back what it
touched; scaled gradients (the last stage's, here) are evidence only, since honest ones
follow the batch's loss.

Real coordinator and agents on loopback; one agent's workers are made bad from outside the
product (tests/agent/worker/badpeer_hook.py: a hook on its stage's output, whatever rank the
coordinator gives it). Two stages of three replicas: what the bad agent's stage sends (its
output on stage 0, its input's gradient on stage 1) is 10x, or zeros, where its weights
compute otherwise, so both ends of its link agree on a figure far from the other pipelines'
(coordinator/integrity/linkwitness.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.integrity.rollback import newest_before
from tests.daemons import Daemons
from tests.system.bad_peer_job import run_with_bad_peer

pytestmark = pytest.mark.timeout(400)
ATTACK_AT = 8
STEPS = 30


def excluded_alone(bad: str, status: dict[str, Any], rows: dict[str, Any], reason: str
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The finished job and the bad agent's exclusion, asserting that the job trained to the
    end, that the bad agent alone was excluded, and that its reason starts with `reason`."""
    done = status["job"]
    assert done["state"] == "done" and done["step"] == STEPS, done
    excluded = [a for a, r in rows.items() if r["state"] == "excluded"]
    assert excluded == [bad], {a: (r["state"], r.get("exclusion")) for a, r in rows.items()}
    exclusion = rows[bad]["exclusion"]
    assert exclusion["reason"].startswith(reason), exclusion
    return done, exclusion


@pytest.mark.parametrize("attack", ["pp_scale", "pp_zero"])
def test_a_peer_sending_wrong_activations_is_named_and_no_honest_agent_is_excluded(
        daemons: Daemons, attack: str) -> None:
    bad, status, rows = run_with_bad_peer(
        daemons, 5, attack, ATTACK_AT, STEPS,
        "--stages", "2", "--replicas", "3", "--batch", "6", "--layer-split", "even")
    done = status["job"]
    assert done["state"] == "done" and done["step"] == STEPS, done
    excluded = [a for a, r in rows.items() if r["state"] == "excluded"]
    kinds = {e["kind"] for e in rows[bad].get("evidence", [])}
    if attack == "pp_scale" and "actgrad_scaled" in kinds:
        # it held the last stage, so it scaled the gradients it sends back: their size follows
        # the batch's loss, so it is evidence, not a verdict; and the honest agents whose
        # gradient copies it spoiled are not excluded for it
        assert excluded == [], rows
        return
    assert excluded == [bad], rows
    exclusion = rows[bad]["exclusion"]
    assert exclusion["reason"].startswith(("act_", "actgrad_zero")), exclusion
    assert ATTACK_AT - 4 <= exclusion["step"] <= ATTACK_AT + 10, exclusion
    first = done["recoveries"][0]
    assert first["resumed_step"] == newest_before(exclusion["step"], 4), (first, exclusion)


def test_a_middle_stage_whose_gain_is_wrong_is_excluded_for_it(daemons: Daemons) -> None:
    """Three stages: the bad agent holds the middle one (rank 4: stage 1 of replica 1, by rank
    order over ascending ports) and sends back 10x the gradient of its input. Raw gradient
    sizes follow the batch's loss and convict nobody; what it sends back over what it
    received (its gain, both figures agreed by the other ends) is 10x its replicas'."""
    bad, status, rows = run_with_bad_peer(
        daemons, 8, "actgrad_scale", ATTACK_AT, STEPS, "--stages", "3", "--replicas", "3",
        "--batch", "6", "--layer-split", "even", "--placement", "rank-order", bad_at=4)
    done, exclusion = excluded_alone(bad, status, rows, "actgrad_scaled")
    assert "the gain (what it sent back over what it received)" in str(
        rows[bad].get("evidence", [])), rows[bad]
    assert ATTACK_AT - 4 <= exclusion["step"] <= ATTACK_AT + 10, exclusion
    first = done["recoveries"][0]
    assert first["resumed_step"] == newest_before(exclusion["step"], 4), (first, exclusion)


@pytest.mark.parametrize("lie", ["lie_one", "lie"])
def test_a_peer_that_misreports_what_it_sends_is_parted_from_its_neighbour_and_named(
        daemons: Daemons, lie: str) -> None:
    """The bad agent sends pipeline messages 10x and reports the figures of what it should
    have sent: the link disagrees at its two ends. Either end may lie, so the coordinator
    names neither, blames nobody for what followed (a receiver fed 10x sends 10x on), and
    places the pair apart; the agent that disagrees with its new neighbour too is the liar
    (`lie_one`: on one link), or the one that disagrees with both its neighbours at once
    (`lie`, every message: a middle stage does). Three stages of three replicas, scheduled
    placement (a swap parts the pair)."""
    bad, status, rows = run_with_bad_peer(
        daemons, 8, lie, ATTACK_AT, STEPS, "--stages", "3", "--replicas", "3",
        "--batch", "6", "--layer-split", "even", "--pp-compress", "none")
    done, exclusion = excluded_alone(bad, status, rows, "link_disagree")
    assert "common to two disagreements" in exclusion["reason"], exclusion
    assert ATTACK_AT - 4 <= exclusion["step"] <= ATTACK_AT + 10, exclusion
    first = done["recoveries"][0]
    assert first["resumed_step"] <= newest_before(exclusion["step"], 4), (first, exclusion)
