"""Real gloo workers with a bad peer injected from outside the product (issue 43, items 1, 4
and 9): the replica checks name it (R = 3) or report the disagreement (R = 2), and name
nobody honest. The bad peer is made by tests/agent/worker/badpeer_hook.py (a torch patch
loaded through badpeer_site/sitecustomize.py), not by the product's DTFM_FAULT, except where
a test says it rehearses that seam."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from dtfm.core.verify import PAIR_WINDOW
from tests.agent.worker.testlib import REPO, run_local

SITE = Path(__file__).resolve().parent / "badpeer_site"
FLAGS = ("--model", "gpt-tiny", "--stages", "1", "--micro-batches", "1", "--eval-batches",
         "0", "--checkpoint-every", "0", "--timeout", "30")


def evidence(workdir: Path) -> list[dict[str, Any]]:
    return [e for p in sorted(workdir.glob("*.progress.jsonl"))
            for line in p.read_text().splitlines()
            if (e := json.loads(line))["event"] == "integrity"]


def bad_peer_env(plan: str, **extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(SITE), str(REPO), os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path, "DTFM_TEST_BAD_PEER": plan, **extra}


@pytest.mark.timeout(120)
def test_three_replicas_name_the_bad_rank_for_every_attack_and_nobody_honest(
        tmp_path: Path) -> None:
    """One run, the attacks in sequence on rank 2: scaled, sign-flipped, noised (three steps:
    a 1-sigma noise at 2 sequences per replica is caught on most steps, not all), stale (step
    7's message again) and zeroed gradient copies, then a weight that drifts after step 10
    (the weights digest runs after step 10, the last). Steps 1 and 3 are honest: nothing is
    reported there, and nothing ever names an honest rank."""
    attacks = {2: "scale", 4: "flip", 5: "noise", 6: "noise", 7: "noise", 8: "stale",
               9: "zero", 10: "drift"}
    plan = "2:" + ",".join(f"{s}={a}" for s, a in attacks.items())
    work = tmp_path / "work"
    run = run_local(*FLAGS, "--replicas", "3", "--batch", "6", "--steps", "10",
                    "--workdir", str(work), timeout=110, env=bad_peer_env(plan))
    assert run.rc == 0, run.stderr
    # The bad rank's own reports are a liar's: the averages it receives are checked against
    # its gradient, not against the altered copies the hook sent for it (avgcheck.py), so it
    # may name the owners; a lone reporter confirms nothing (corroborate.py).
    found = [e for e in evidence(work) if e["rank"] != 2 or e["kind"] == "weights"]
    assert found and {e["suspect_rank"] for e in found} == {2}, found  # nobody honest
    # the replicas' audit of the averages (avgaudit.py): rank 2 reports figures of the copy
    # it computed, not of the one its hook sent, at every attacked step but the drift's
    claims = {e["step"] for e in found if e["kind"] == "avg_claims"}
    assert claims == set(attacks) - {10}, claims
    found = [e for e in found if e["kind"] != "avg_claims"]
    by_step: dict[int, set[str]] = {}
    for e in found:
        by_step.setdefault(e["step"], set()).add(e["kind"])
    assert "grad_norm" in by_step[2], by_step
    assert by_step[4] & {"grad_cosine", "grad_norm"}, by_step
    assert any(by_step.get(s) for s in (5, 6, 7)), by_step
    assert by_step[8] == {"grad_stale"} and by_step[9] == {"grad_zero"}, by_step
    # all three replicas' digests: 2 is odd. Its quiet energy may be named here too: the
    # window of steps 6-10 holds 6 and 7 noised and 8 (7's noised copy again)
    assert by_step[10] - {"grad_noise"} == {"weights"}, by_step
    assert {e["rank"] for e in found if e["kind"] == "weights"} == {0, 1, 2}, found
    assert not set(by_step) & {1, 3}, by_step


@pytest.mark.timeout(120)
def test_two_replicas_report_the_disagreement_undecided(tmp_path: Path) -> None:
    """R = 2: copies scaled x10 from step 2 on (the product's rehearsal seam, DTFM_FAULT, so
    its `tamper` path runs too) and a weight that drifts after step 3 (the test's hook) are
    reported, naming nobody (-1): either replica may be wrong. The pair is judged over a
    window of `PAIR_WINDOW` (9) steps, so the first verdict is at step 9."""
    work = tmp_path / "work"
    run = run_local(*FLAGS, "--replicas", "2", "--batch", "4", "--steps", str(PAIR_WINDOW + 1),
                    "--workdir", str(work), timeout=110,
                    env=bad_peer_env("1:3=drift", DTFM_FAULT="1:2:scale"))
    assert run.rc == 0, run.stderr
    found = evidence(work)
    assert {e["suspect_rank"] for e in found} == {-1}, found
    kinds = {(e["step"], e["kind"]) for e in found}
    assert {(s, "grad_disagree") for s in (PAIR_WINDOW, PAIR_WINDOW + 1)} <= kinds, found
    assert (PAIR_WINDOW + 1, "weights_disagree") in kinds, found  # the last step's digest
    assert not {s for s, _ in kinds} & set(range(1, PAIR_WINDOW)), found


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seam", ["hook", "rehearsal"])
def test_an_owner_that_sends_one_receiver_another_average_is_disputed_not_the_receiver(
        tmp_path: Path, seam: str) -> None:
    """R = 3: at step 5 only, owner rank 2 sends its first receiver, rank 0, ten times its
    average and steps with the honest one (`avg_one`). Rank 0's weights then differ from
    the others' at the digest of step 10, and the digest alone would name it, the honest
    one. The audit's figures show that rank 0 got another average than rank 2 accounts for,
    which either may have made up: the two report a dispute of each other at step 5
    (`avg_disagree`, settled by the coordinator as an R = 2 pair's), and no replica names
    rank 0. `rehearsal`: the product's seam (`DTFM_FAULT`, from step 5 on) does the same."""
    work = tmp_path / "work"
    env = bad_peer_env("2:5=avg_one") if seam == "hook" else {"DTFM_FAULT": "2:5:avg_one"}
    run = run_local(*FLAGS, "--replicas", "3", "--batch", "6", "--steps", "10",
                    "--workdir", str(work), timeout=110, env=env)
    assert run.rc == 0, run.stderr
    found = evidence(work)
    disputes = sorted((e["rank"], e["suspect_rank"], e["step"]) for e in found
                      if e["kind"] == "avg_disagree")
    assert disputes == [(0, 2, 5), (2, 0, 5)], found
    assert not [e for e in found if e["suspect_rank"] == 0 and e["kind"] != "avg_disagree"], \
        found
    assert not [e for e in found if e["kind"] == "weights"], found
    assert "not the one rank 2 accounts for" in run.stderr + "".join(
        e["detail"] for e in found)


def two_stages_of_three(tmp_path: Path, env: dict[str, str]) -> list[dict[str, Any]]:
    """Ten steps of 2 x 3 with a bad peer made by `env`; the integrity events."""
    work = tmp_path / "work"
    run = run_local(*FLAGS[:2], "--stages", "2", *FLAGS[4:], "--replicas", "3", "--batch", "6",
                    "--steps", "10", "--workdir", str(work), timeout=110, env=env)
    assert run.rc == 0, run.stderr
    return evidence(work)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seam", ["hook", "rehearsal"])
def test_a_rank_lying_about_its_norm_is_named_and_its_pipeline_partner_is_not(
        tmp_path: Path, seam: str) -> None:
    """Two stages of three replicas: rank 1 (stage 1 of replica 0) sends its pipeline 100x its
    squared gradient norm from step 2 on, and clips with its own (`norm_lie`). Rank 0, its
    stage-0 partner, clips with another coefficient, so its weights differ from ranks 2 and
    4's at the digest of step 10, and the digest alone named it, the honest one. The
    pipelines' squared norms travel with the digest (agent/worker/normtable.py): stage 0's
    replicas name rank 1 for the norm it sent (`norm_differs`, at the first such step), and
    nobody names rank 0. `rehearsal`: the product's seam (`DTFM_FAULT`) does the same."""
    plan = "1:" + ",".join(f"{s}=norm_lie" for s in range(2, 11))
    found = two_stages_of_three(tmp_path, bad_peer_env(plan) if seam == "hook" else {
        "DTFM_FAULT": "1:2:norm_lie"})
    named = {(e["rank"], e["suspect_rank"], e["step"]) for e in found
             if e["kind"] == "norm_differs"}
    assert named == {(0, 1, 2), (2, 1, 2), (4, 1, 2)}, found
    assert not [e for e in found if e["suspect_rank"] == 0], found
    assert not [e for e in found if e["kind"] == "weights"], found


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seam", ["hook", "rehearsal"])
def test_a_drifted_rank_that_forges_its_norm_table_has_its_replicas_report_what_it_shows(
        tmp_path: Path, seam: str) -> None:
    """Two stages of three replicas: rank 0 (stage 0 of replica 0) drifts after step 2 and
    writes in its own norm table that rank 1, its stage-1 partner, sent 100x its squared
    norm at step 2 (`norm_forge`). Its replicas cannot tell its row from an honest one: they
    name rank 1 (`norm_differs`) and nobody names rank 0 for `weights`; the coordinator
    makes the two a dispute, since stage 0 alone shows it (tests/coordinator/
    test_norm_dispute.py, tests/system/test_bad_peer_excluded.py). Stage 1's digest finds
    nothing: its replicas agree."""
    found = two_stages_of_three(tmp_path, bad_peer_env("0:2=norm_forge") if seam == "hook"
                                else {"DTFM_FAULT": "0:2:norm_forge"})
    named = {(e["rank"], e["suspect_rank"], e["step"]) for e in found
             if e["kind"] == "norm_differs"}
    assert {(2, 1, 2), (4, 1, 2)} <= named <= {(0, 1, 2), (2, 1, 2), (4, 1, 2)}, found
    assert not [e for e in found if e["kind"] == "weights"], found
    assert not [e for e in found if e["rank"] % 2 == 1], found  # stage 1 saw nothing


@pytest.mark.timeout(120)
def test_a_digest_is_judged_a_step_after_it_is_taken_and_says_so(tmp_path: Path) -> None:
    """1 x 3, rank 2's weights drift after step 3; the digest of step 10 is posted to the
    replicas then and judged at step 11's end (its exchange overlaps step 11): its `weights`
    record, of step 10, comes after step 10's event and before step 11's, and step 10's
    event says its records are out through step 0 only (`judged_through`), step 11's
    through itself. The last step's digest is judged at once."""
    work = tmp_path / "work"
    run = run_local(*FLAGS, "--replicas", "3", "--batch", "6", "--steps", "12",
                    "--workdir", str(work), timeout=110, env=bad_peer_env("2:3=drift"))
    assert run.rc == 0, run.stderr
    lines = [json.loads(line) for line in (work / "rank0.progress.jsonl").read_text()
             .splitlines()]
    order = [(e["event"], e["step"], e.get("kind"), e.get("judged_through"))
             for e in lines if e["event"] in ("step", "integrity")]
    at = order.index(("integrity", 10, "weights", None))
    assert order[at - 1] == ("step", 10, None, 0) and order[at + 1] == ("step", 11, None, -1)
    assert ("integrity", 12, "weights", None) in order  # the last digest, judged at once
    assert ("step", 12, None, -1) in order
