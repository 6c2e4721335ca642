"""Real gloo workers (1 x 3, `sharded`) in which one replica sends a NaN and an infinity
(agent/worker/nonfinite.py). Before, every replica computed a NaN gradient norm and failed
with `NonFiniteLoss`, kind `config`: the job failed as the user's configuration, nobody named.
Now the bad rank is named by its honest peers (`bad_value`, with evidence the coordinator's
ledger confirms), and no worker reports `config`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.agent.worker.test_replica_checks import FLAGS, bad_peer_env
from tests.agent.worker.testlib import LocalRun, run_local

ONSET = 2
GROUP = "replica 2 of data-parallel ranks [0, 1, 2]"


def _run(tmp_path: Path, env: dict[str, str], *flags: str
         ) -> tuple[LocalRun, list[dict[str, Any]]]:
    work = tmp_path / "work"
    run = run_local(*FLAGS, "--replicas", "3", "--batch", "6", "--steps", "3",
                    "--workdir", str(work), *flags, timeout=110, env=env)
    events = [json.loads(line) for p in sorted(work.glob("*.progress.jsonl"))
              for line in p.read_text().splitlines()]
    return run, events


def _named(events: list[dict[str, Any]], kind: str) -> None:
    """Ranks 0 and 1 fail as `bad_value` naming rank 2 and hold `kind` evidence against it;
    nobody fails as `config`, nobody honest is named."""
    failed = {e["rank"]: e for e in events if e["event"] == "error"}
    assert failed and all(e["kind"] != "config" for e in failed.values()), failed
    for honest in (0, 1):
        assert failed[honest]["kind"] == "bad_value", failed
        assert f"rank {honest}: rank 2 ({GROUP}) sent" in failed[honest]["message"], failed
    found = [e for e in events if e["event"] == "integrity" and e["kind"] == kind]
    assert {(e["rank"], e["suspect_rank"], e["step"]) for e in found} == \
        {(0, 2, ONSET), (1, 2, ONSET)}, found


@pytest.mark.timeout(120)
def test_the_owners_name_a_replica_that_sends_nan_copies(tmp_path: Path) -> None:
    """Rank 2 sends every shard copy with a NaN and an infinity at step 2, its own gradient
    finite (tests/agent/worker/badpeer_hook.py: from outside the product)."""
    run, events = _run(tmp_path, bad_peer_env(f"2:{ONSET}=nan"))
    assert run.rc != 0, run.stderr
    _named(events, "grad_nonfinite")
    assert f"rank 2 ({GROUP}) sent a copy of the gradient shard" in run.stderr, run.stderr
    assert "NonFiniteLoss" not in run.stderr


@pytest.mark.timeout(120)
def test_the_receivers_name_an_owner_that_sends_back_a_nan_average(tmp_path: Path) -> None:
    """Rank 2, owner of a third of every bucket, sends back its averages with a NaN and an
    infinity at step 2 (the rehearsal seam, `DTFM_FAULT=2:2:avg_nan`) and steps with them
    itself: it says its own mean is not finite (`internal`), its receivers name it."""
    run, events = _run(tmp_path, {"DTFM_FAULT": f"2:{ONSET}:avg_nan"})
    assert run.rc != 0, run.stderr
    _named(events, "avg_nonfinite")
    failed = {e["rank"]: e for e in events if e["event"] == "error"}
    assert failed[2]["kind"] == "internal" and "rank 2: its own average" in \
        failed[2]["message"], failed
    assert "rank 2: its own average" in run.stderr, run.stderr


@pytest.mark.timeout(120)
def test_a_job_that_diverges_still_fails_as_its_configuration(tmp_path: Path) -> None:
    """Every replica's own gradient is NaN at step 2 (--lr 1e30): each says so itself
    (`NonFiniteLoss`, `config`, with its own NaN loss) and nobody blames a peer, though each
    owner zeroed the others' NaN copies."""
    run, events = _run(tmp_path, {}, "--lr", "1e30", "--warmup-steps", "0", "--grad-clip", "0")
    assert run.rc != 0, run.stderr
    failed = [e for e in events if e["event"] == "error"]
    assert {e["rank"] for e in failed} == {0, 1, 2}, failed
    assert all(e["kind"] == "config" and "NonFiniteLoss: the loss of step 2 is nan" in
               e["message"] for e in failed), failed
    assert not [e for e in events if e["event"] == "integrity"], events
