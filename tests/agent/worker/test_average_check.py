"""Real gloo workers in which one shard's owner alters the average it sends back (issue 43,
item 2): its receivers name it (agent/worker/avgcheck.py), and nobody honest is named. The
bad owner is made by tests/agent/worker/badpeer_hook.py (a torch patch, outside the
product); it steps with its altered average too, so the weights digest agrees and only the
receivers' check can see it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.agent.worker.test_replica_checks import FLAGS, bad_peer_env, evidence
from tests.agent.worker.testlib import run_local


@pytest.mark.timeout(120)
def test_receivers_name_the_owner_that_alters_its_average(tmp_path: Path) -> None:
    """Rank 2 owns a third of every bucket; steps 1-3 are honest (the receivers' reference),
    then it sends back its averages scaled x10 (4, 5), sign-flipped x-4 (6, 7), replayed
    (8: step 7's again), and zeroed at step 9 through the product's rehearsal seam
    (`DTFM_FAULT=2:9:avg_zero`, its `tamper_average` path)."""
    attacks = {4: "avg_scale", 5: "avg_scale", 6: "avg_flip", 7: "avg_flip", 8: "avg_stale"}
    plan = "2:" + ",".join(f"{s}={a}" for s, a in attacks.items())
    work = tmp_path / "work"
    run = run_local(*FLAGS, "--replicas", "3", "--batch", "6", "--steps", "9",
                    "--workdir", str(work), timeout=110,
                    env=bad_peer_env(plan, DTFM_FAULT="2:9:avg_zero"))
    assert run.rc == 0, run.stderr
    everything = evidence(work)
    assert everything and {e["suspect_rank"] for e in everything} == {2}, everything
    # the replicas' audit (avgaudit.py): every replica judges the same figures, rank 2 too;
    # the altered averages of steps 4-8 are not the mean of what it says it received
    audit = [e for e in everything if e["kind"] == "avg_mismatch"]
    assert {e["step"] for e in audit} == {4, 5, 6, 7, 8}, audit
    assert {e["rank"] for e in audit} == {0, 1, 2}, audit
    found = [e for e in everything if e["kind"] != "avg_mismatch"]
    assert {e["rank"] for e in found} == {0, 1}, found  # its two receivers
    by_step: dict[int, set[str]] = {}
    for e in found:
        by_step.setdefault(e["step"], set()).add(e["kind"])
    assert not set(by_step) & {1, 2, 3}, by_step
    assert any(by_step.get(s, set()) & {"avg_norm", "avg_cosine"} for s in range(4, 8)), by_step
    assert by_step[8] == {"avg_stale"} and by_step[9] == {"avg_zero"}, by_step
    assert {e["rank"] for e in found if e["step"] == 9} == {0, 1}, found
