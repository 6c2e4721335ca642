"""Pipeline activations and their gradients, checked from both ends of every link
(coordinator/integrity/linkwitness.py): who is named for a wrong link, who is not (the stages
a wrong input flowed through, a receiver's word alone), and R = 2's undecided pair."""

from __future__ import annotations

import math

from coordinator.integrity.linkwitness import (
    AGREE_TOL,
    CONFIRM_RATIO,
    MAX_HELD,
    PERSIST_WINDOWS,
    LinkWitness,
    links,
)
from dtfm.core.verify import LINK_WINDOW, onset

NAN = math.nan
S, R = 3, 3  # ranks: replica * S + stage


def honest(stages: int = S, replicas: int = R, act: float = 1.0,
           grad: float = 0.01) -> dict[int, list[float]]:
    """Every rank's figures (act_out, act_in, grad_out, grad_in) of an honest window."""
    out = {}
    for r in range(replicas):
        for s in range(stages):
            out[r * stages + s] = [act if s < stages - 1 else NAN, act if s > 0 else NAN,
                                   grad if s > 0 else NAN, grad if s < stages - 1 else NAN]
    return out


def witness(stages: int = S, replicas: int = R) -> LinkWitness:
    w = LinkWitness()
    w.plan(2, stages, replicas)
    return w


def feed(w: LinkWitness, step: int, figures: dict[int, list[float]], epoch: int = 2) -> list:
    for rank, f in figures.items():
        w.add(epoch, rank, step, f)
    return w.judge()


def test_links_run_in_the_order_a_step_computes_them() -> None:
    order = [(k.kind, k.boundary, k.sender, k.receiver) for k in links(3, 2) if k.replica == 1]
    assert order == [("act", 1, 3, 4), ("act", 2, 4, 5), ("actgrad", 2, 5, 4),
                     ("actgrad", 1, 4, 3)]


def test_honest_windows_name_nobody_and_wait_for_every_member() -> None:
    w = witness()
    figures = honest()
    partial = {r: f for r, f in figures.items() if r != 4}
    assert feed(w, 5, partial) == []  # rank 4's window not in yet: nothing judged
    w.add(2, 4, 5, figures[4])
    assert w.judge() == []
    # small honest differences between replicas (other data) stay quiet
    figures[1][1] = figures[0][0] = 1.1
    assert feed(w, 10, figures) == []


def test_a_sender_that_scales_what_it_sends_is_named_not_the_stages_after_it() -> None:
    """Rank 3 (stage 0 of replica 1) sends x10: its receiver rank 4 agrees, and rank 4's own
    output, and every gradient back, are wrong too; only rank 3 is named, confirmed."""
    w = witness()
    f = honest()
    f[3][0] = f[4][1] = 10.0  # the link 3 -> 4, both ends agreeing
    f[4][0] = f[5][1] = 9.0  # what followed from it
    f[5][2] = f[4][3] = f[4][2] = f[3][3] = 0.05
    found = feed(w, 10, f)
    assert [(x.kind, x.suspects, x.confirmed) for x in found] == [("act_scaled", (3,), True)]
    # the activations after it and the last stage's gradients back; rank 4's gain (what it
    # sent back over what it received) is its replicas', so its gradients are not counted
    assert "1 later link" not in found[0].detail and "2 later link(s)" in found[0].detail
    assert found[0].onset == 10 - LINK_WINDOW + 1 == onset("act_scaled", 10)


def test_zeros_and_scaled_gradients_name_their_sender() -> None:
    w = witness()
    f = honest()
    f[8][2] = f[7][3] = 0.0  # rank 8 (last stage, replica 2) sends zero gradients back
    f[7][2] = f[6][3] = 0.0  # and so does rank 7, computing from them
    found = feed(w, 5, f)
    assert [(x.kind, x.suspects, x.confirmed) for x in found] == [("actgrad_zero", (8,), True)]
    # the last stage's gradients (rank 2), and rank 1's computed from them: the last stage is
    # named, not confirmed (a hard batch does it; it has no gain to judge instead)
    f = honest()
    f[2][2] = f[1][3] = f[1][2] = f[0][3] = 0.01 * CONFIRM_RATIO * 2
    assert [(x.kind, x.suspects, x.confirmed) for x in feed(w, 10, f)] == [
        ("actgrad_scaled", (2,), False)]
    f = honest()
    f[2][2] = f[1][3] = f[1][2] = f[0][3] = 0.015  # 1.5x: their honest spread comes close
    for step in range(15, 15 + 5 * PERSIST_WINDOWS, 5):
        assert [(x.kind, x.confirmed) for x in feed(w, step, f)] == [("actgrad_scaled", False)]


def test_a_middle_stage_is_judged_by_its_gain_which_a_hard_batch_does_not_move() -> None:
    """Rank 1 (stage 1 of 3) receives honest gradients and sends back 6x: what it sent over
    what it received is 6x its replicas' gain, confirmed. The same 6x arriving from a hard
    batch at the last stage leaves rank 1's gain alone (only the last stage is named, as
    evidence), and does not hide a middle stage that scales in the same window."""
    w = witness()
    f = honest()
    f[1][2] = f[0][3] = 0.06
    found = feed(w, 5, f)
    assert [(x.kind, x.suspects, x.confirmed) for x in found] == [
        ("actgrad_scaled", (1,), True)]
    assert "6x the gain (what it sent back over what it received)" in found[0].detail
    f = honest()
    f[5][2] = f[4][3] = 0.06  # a hard batch at replica 1's last stage
    f[4][2] = f[3][3] = 0.06  # rank 4's gradients follow it: its gain is 1
    found = feed(w, 10, f)
    assert [(x.kind, x.suspects, x.confirmed) for x in found] == [
        ("actgrad_scaled", (5,), False)]
    f = honest()
    f[5][2] = f[4][3] = 0.06  # the same, where rank 4 also scales 3x of that
    f[4][2] = f[3][3] = 0.18
    found = feed(w, 15, f)
    assert [(x.kind, x.suspects, x.confirmed) for x in found] == [
        ("actgrad_scaled", (5,), False), ("actgrad_scaled", (4,), True)]
    # a gain off by noise of about one sigma (1.41x and up): confirmed once it persists
    f = honest()
    f[7][2] = f[6][3] = 0.015
    for i in range(1, PERSIST_WINDOWS + 1):
        found = feed(w, 15 + i * LINK_WINDOW, f)
        assert [(x.kind, x.suspects, x.confirmed) for x in found] == [
            ("actgrad_scaled", (7,), i == PERSIST_WINDOWS)]


def test_ends_that_disagree_are_evidence_against_both_and_frame_nobody() -> None:
    """A receiver that says it got 10x what its sender says it sent: the coordinator cannot
    tell which lies, confirms nothing, and does not blame the sender for the receiver's
    figure."""
    w = witness()
    f = honest()
    f[4][1] = 10.0  # rank 4 claims rank 3 sent it 10x; rank 3 says 1.0
    found = feed(w, 5, f)
    assert [(x.kind, set(x.suspects), x.confirmed) for x in found] == [
        ("link_disagree", {3, 4}, False)]
    f = honest()
    f[4][1] = 1.0 + AGREE_TOL / 2  # a codec's rounding: within the tolerance
    assert feed(w, 10, f) == []


def test_a_smaller_deviation_is_evidence_until_it_persists() -> None:
    w = witness()
    f = honest()
    f[6][0] = f[7][1] = 1.5  # noise of about one sigma and more: 1.41x and up
    for i in range(1, PERSIST_WINDOWS + 1):
        found = feed(w, i * LINK_WINDOW, f)
        assert [(x.kind, x.suspects) for x in found] == [("act_scaled", (6,))]
        assert found[0].confirmed == (i == PERSIST_WINDOWS)
    # a window without it resets the count
    feed(w, (PERSIST_WINDOWS + 1) * LINK_WINDOW, honest())
    found = feed(w, (PERSIST_WINDOWS + 2) * LINK_WINDOW, f)
    assert not found[0].confirmed


def test_two_replicas_name_the_pair_of_senders_at_the_first_boundary_that_differs() -> None:
    w = witness(3, 2)
    f = honest(3, 2)
    f[4][0] = f[5][1] = 10.0  # stage 1 of replica 1 (rank 4) scales: boundary 2 differs
    f[5][2] = f[4][3] = 0.1  # the gradients back follow
    f[4][2] = f[3][3] = 0.1
    found = feed(w, 5, f)
    assert [(x.kind, x.suspects, x.confirmed) for x in found] == [
        ("act_disagree", (1, 4), False)]  # ranks 1 and 4: the two replicas of stage 1
    f = honest(3, 2)
    f[4][0] = f[5][1] = 1.4  # an honest pair's windows reach that: no dispute
    assert feed(w, 15, f) == []
    f = honest(3, 2)
    f[5][2] = f[4][3] = 0.1  # gradients 10x: a hard batch on one side does it, no dispute
    f[4][2] = f[3][3] = 0.1  # (rank 4's follow them: its gain is its replica's)
    assert feed(w, 20, f) == []
    f = honest(3, 2)
    f[4][2] = f[3][3] = 0.1  # but rank 4's gain 10x its replica's: the pair disputed
    assert [(x.kind, x.suspects, x.confirmed) for x in feed(w, 25, f)] == [
        ("act_disagree", (1, 4), False)]
    f = honest(3, 2)
    f[0][0] = f[1][1] = 0.0  # zeros are no matter of opinion, even with two
    assert [(x.kind, x.suspects, x.confirmed) for x in feed(w, 10, f)] == [
        ("act_zero", (0,), True)]


def test_what_a_peer_can_make_the_witness_hold_is_bounded() -> None:
    w = witness()
    for step in range(LINK_WINDOW, 10_000, LINK_WINDOW):  # one member's, never the others'
        w.add(2, 0, step, [1.0, NAN, NAN, NAN])
    assert w.held <= MAX_HELD
    w = witness()
    feed(w, 5, {r: f for r, f in honest().items() if r != 8})  # waiting for rank 8
    for ahead in range(MAX_HELD + 10):  # a member racing ahead, or lying, window after window
        w.add(2, 0, 10**9 + ahead, [1.0, NAN, NAN, NAN])
    assert w.held <= MAX_HELD
    f = honest()
    f[6][0] = f[7][1] = 0.0  # step 5 is judged all the same, and finds what it holds
    w.add(2, 6, 5, f[6])
    assert [x.kind for x in feed(w, 5, {7: f[7], 8: f[8]})] == ["act_zero"]
    w = witness()
    w.add(2, 99, 5, [1.0] * 4)  # a rank outside the layout
    w.add(1, 0, 5, [1.0] * 4)  # another epoch's
    w.add(2, 0, 5, [1.0])  # a short row
    assert w.held == 0


def test_what_follows_a_link_whose_ends_disagree_blames_nobody_downstream() -> None:
    """A sender that reports honest figures and sends 10x (`act_lie`): its receiver, honest,
    says so, and then sends on what followed from it, its own receiver agreeing. The link
    that disagrees comes first in the pipeline: what follows it is not the receiver's fault
    (before: rank 4 was confirmed for activations 9x its replicas', and excluded)."""
    w = witness()
    f = honest()
    f[3][0] = 1.0  # rank 3 says it sent 1.0 ...
    f[4][1] = 10.0  # ... rank 4 received 10x
    f[4][0] = f[5][1] = 9.0  # what followed from it, both ends agreeing
    f[5][2] = f[4][3] = f[4][2] = f[3][3] = 0.05
    found = feed(w, 10, f)
    assert [(x.kind, set(x.suspects), x.confirmed) for x in found] == [
        ("link_disagree", {3, 4}, False)]
    assert "2 later link(s)" in found[0].detail


def test_without_flushes_gains_are_not_judged_but_activations_and_zeros_are() -> None:
    """`--pipeline-delay 1`: a stale step's honest gains spread past the thresholds (4.7
    against 1.25 between two replicas of one stage on the 8-city world), so the witness of
    such an epoch leaves gains alone."""
    w = LinkWitness()
    w.plan(2, 3, 2, judge_gains=False)
    f = honest(3, 2)
    f[4][2] = f[3][3] = 0.1  # rank 4's gain 10x its replica's: disputed with flushes, not here
    assert feed(w, 5, f) == []
    f = honest(3, 2)
    f[4][0] = f[5][1] = 10.0  # activations are still judged
    f[5][2] = f[4][3] = f[4][2] = f[3][3] = 0.1
    assert [(x.kind, x.suspects) for x in feed(w, 10, f)] == [("act_disagree", (1, 4))]
    f = honest(3, 2)
    f[0][0] = f[1][1] = 0.0  # and zeros
    assert [(x.kind, x.suspects) for x in feed(w, 15, f)] == [("act_zero", (0,))]
    w.plan(3, 3, 2)  # the next epoch flushes again: gains judged
    f = honest(3, 2)
    f[4][2] = f[3][3] = 0.1
    assert [x.kind for x in feed(w, 5, f, epoch=3)] == ["act_disagree"]
