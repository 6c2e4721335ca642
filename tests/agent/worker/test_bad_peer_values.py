"""A peer's impossible numbers are the peer's fault, not the job's configuration (issue 41, 9).

An agent whose workers sent their values times -4 made an honest worker take the square root
of a negative global gradient norm: `ValueError: math domain error`, classed `config`, and the
coordinator failed the job as "the job's configuration is invalid". Now:

- the exchanged squared norms and loss are checked where they arrive (`globalnorm.checked`):
  a peer's negative or non-finite one is a `bad_value` error (retried) naming the sender; this
  rank's own non-finite values stay `NonFiniteLoss` (`config`: diverged or NaN weights);
- arithmetic on a bad number that slips past is `internal` (retried), never `config`;
- real gloo workers (`agent local`, the `DTFM_FAULT` seam's `corrupt` mode): rank 1 sends its
  values times -4; no worker reports `config`, and the named failure blames rank 1; under the
  real coordinator and agents the job recovers, the recovery names rank 1, and it finishes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from agent.worker import errors
from agent.worker.badpeer import NORM_LIE_SCALE
from agent.worker.fault import CORRUPT_SCALE, Fault
from agent.worker.globalnorm import BadPeerValue, checked
from coordinator.job import rootcause
from coordinator.job.recovery import permanent_failure
from dtfm.core import causes
from tests.agent.worker.testlib import run_local
from tests.daemons import Daemons, wait_for

PIPE = [4, 5, 6]  # ranks of stages 0..2 of replica 1 (a 3x2 layout's second replica)


def test_honest_values_give_the_norm_and_loss_in_stage_order() -> None:
    norm, loss = checked([[1.0, 0.0], [4.0, 0.0], [0.25, 2.5]], PIPE, 5, 1, 3)
    assert norm == math.sqrt(1.0 + 4.0 + 0.25) and loss == 2.5


@pytest.mark.parametrize("bad", [-4.0, math.nan, math.inf, -math.inf])
def test_a_peers_impossible_squared_norm_is_a_peer_fault_naming_it(bad: float) -> None:
    with pytest.raises(BadPeerValue) as info:
        checked([[1.0, 0.0], [2.0, 0.0], [bad, 2.5]], PIPE, 4, 1, 7)
    e = info.value
    assert e.sender == 6
    assert f"rank 4: rank 6 (stage 2, replica 1) sent a squared gradient norm of {bad!r} " \
           f"at step 7" in str(e)
    assert "not this job's configuration" in str(e)
    assert errors.classify(e, errors.TRAIN) == errors.BAD_VALUE
    kind = errors.classify(e, errors.TRAIN)
    assert permanent_failure(errors.describe(e), kind, 7, (kind, 0)) == ""  # retried
    # named over the sender's own "connection closed" that follows, not over its config error
    assert causes.outranks(kind, errors.PEER) and causes.outranks(errors.CONFIG, kind)
    assert rootcause.hold_s(kind, 0.0, 0.0, 1.0) > 0  # the sender's own report may follow


def test_a_peers_non_finite_loss_names_the_last_stage() -> None:
    with pytest.raises(BadPeerValue, match=r"rank 6 \(stage 2, replica 1\) sent a loss of nan"):
        checked([[1.0, 0.0], [2.0, 0.0], [3.0, math.nan]], PIPE, 4, 1, 7)


def test_this_ranks_own_non_finite_values_stay_its_config_error() -> None:
    """A diverged pipeline computes non-finite values on every rank: each says so itself
    (`NonFiniteLoss`, config) before looking at its peers' values."""
    with pytest.raises(errors.NonFiniteLoss, match="gradient norm of step 7 is nan"):
        checked([[1.0, 0.0], [math.nan, 0.0], [-1.0, 2.5]], PIPE, 5, 1, 7)
    with pytest.raises(errors.NonFiniteLoss, match="the loss of step 7 is nan"):
        checked([[math.nan, 0.0], [math.nan, 0.0], [math.nan, math.nan]], PIPE, 6, 1, 7)
    with pytest.raises(errors.NonFiniteLoss):  # finite squares whose sum overflows
        checked([[1e308, 0.0], [1e308, 0.0], [1e308, 1.0]], PIPE, 6, 1, 7)


def test_arithmetic_on_a_bad_number_is_not_a_config_error() -> None:
    for slip in (ValueError("math domain error"),
                 ValueError("cannot convert float NaN to integer")):
        assert errors.classify(slip, errors.TRAIN) == errors.INTERNAL, slip
        assert errors.classify(slip, errors.JOIN) == errors.INTERNAL, slip
    # what really is configuration stays so
    assert errors.classify(ValueError("--lr must be > 0"), errors.TRAIN) == errors.CONFIG
    assert errors.classify(errors.NonFiniteLoss(1, math.nan, 1.0), errors.TRAIN) == errors.CONFIG
    assert errors.classify(FileNotFoundError("data.bin"), errors.TRAIN) == errors.CONFIG


def test_the_corrupt_fault_scales_what_one_rank_sends_from_its_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTFM_FAULT", "1:2:corrupt:1")
    fault = Fault.from_env()
    assert fault is not None
    both = (CORRUPT_SCALE, CORRUPT_SCALE)
    assert [fault.sent_scale(1, s, 1) for s in (1, 2, 3)] == [(1.0, 1.0), both, both]
    assert fault.sent_scale(0, 3, 1) == (1.0, 1.0) and fault.sent_scale(1, 3, 2) == (1.0, 1.0)
    monkeypatch.setenv("DTFM_FAULT", "*:2:norm_lie")
    lie = Fault.from_env()
    assert lie is not None  # the squared norm only, from its step, whatever the rank
    assert [lie.sent_scale(5, s) for s in (1, 2)] == [(1.0, 1.0), (NORM_LIE_SCALE, 1.0)]
    fault.maybe_fire(1, 2, 1)  # returns: the corruption is in what it sends
    monkeypatch.setenv("DTFM_FAULT", "1:2:explode")
    with pytest.raises(ValueError, match="corrupt"):
        Fault.from_env()


@pytest.mark.timeout(240)
def test_a_peer_sending_values_times_minus_4_is_blamed_not_the_configuration(
        tmp_path: Path) -> None:
    work = tmp_path / "work"
    run = run_local("--stages", "2", "--replicas", "1", "--batch", "2", "--micro-batches", "1",
                    "--steps", "4", "--eval-batches", "1", "--timeout", "30",
                    "--checkpoint-every", "0", "--workdir", str(work), timeout=200,
                    env={"DTFM_FAULT": "1:2:corrupt"})
    assert run.rc == 1, run.stderr
    events = [json.loads(line) for p in sorted(work.glob("*.progress.jsonl"))
              for line in p.read_text().splitlines()]
    failed = [e for e in events if e["event"] == "error"]
    assert failed and all(e["kind"] != "config" for e in failed), failed
    blame = "rank 0: rank 1 (stage 1, replica 0) sent a squared gradient norm of -"
    honest = [e for e in failed if e["rank"] == 0]
    assert honest and honest[0]["kind"] == "bad_value" and blame in honest[0]["message"], failed
    assert blame in run.stderr, run.stderr  # the failure `agent local` names blames rank 1
    assert "math domain error" not in run.stdout + run.stderr


@pytest.mark.timeout(300)
def test_a_cluster_job_recovers_from_a_bad_peer_and_names_it(daemons: Daemons) -> None:
    """The real coordinator and agents: the rank that sends -4x values in epoch 1 is named in
    the recovery's reason, the job is retried (not failed as invalid configuration) and
    finishes in epoch 2."""
    _, address = daemons.coordinator(
        "--model", "gpt-tiny", "--agents", "2", "--stages", "2", "--replicas", "1",
        "--steps", "4", "--batch", "2", "--micro-batches", "1", "--eval-batches", "1",
        "--no-measure", "--search-seconds", "1", "--max-restarts", "3")
    for i in range(2):
        daemons.agent(address, f"agent-{i}", "--no-prewarm",
                      env=daemons.env(DTFM_FAULT="1:2:corrupt:1"))
    job = wait_for(lambda: (s := daemons.status(address)["job"])["state"] in ("done", "failed")
                   and s, 260, f"the job to end (logs in {daemons.tmp})", 1.0)
    assert job["state"] == "done", job
    reasons = [r["reason"] for r in job["recoveries"]]
    assert reasons and "BadPeerValue: rank 0: rank 1 (stage 1, replica 0) sent a squared " \
        "gradient norm of -" in reasons[0], reasons
    assert "invalid" not in reasons[0] and job["epoch"] == 2, job
