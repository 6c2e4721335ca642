"""A peer's impossible value (`bad_value`) is a peer fault the job recovers from, named over
the sender's own error, and held like `peer` so a sender that diverged by itself still fails
the job as `config` (issue 41, item 9). Real `Job`, fake registry and agents (test_job_states).
"""

from __future__ import annotations

import asyncio

from dtfm.core.workerstate import WorkerState
from tests.coordinator.test_job_states import FAILED, RECOVERING, Harness, config, run, until

CLOSED = "PeerError: rank 1: pipeline receive failed after 0.2 s: Connection closed by peer"
BAD = ("BadPeerValue: rank 0: rank 1 (stage 1, replica 0) sent a squared gradient norm of "
       "-12.5 at step 3: a value no honest worker computes")


def test_a_bad_value_is_recovered_from_and_names_the_sender_over_its_own_error() -> None:
    async def body(h: Harness) -> None:
        await h.running_epoch(1)
        h.report("agent-1", WorkerState.FAILED, error=CLOSED, error_kind="peer")  # the sender
        await asyncio.sleep(0.02)
        h.report("agent-0", WorkerState.FAILED, error=BAD, error_kind="bad_value")
        await until(lambda: h.job.epoch == 2)  # retried: recovered onto a new epoch
        assert RECOVERING in h.job.entered and FAILED not in h.job.entered
        reason = h.job.recoveries.items[-1].reason
        assert reason.startswith("worker on agent-0 failed: BadPeerValue") and \
            "rank 1 (stage 1, replica 0)" in reason, reason
        assert "invalid" not in reason
    run(config(max_restarts=3), body)


def test_a_sender_that_diverged_by_itself_still_fails_the_job_as_config() -> None:
    """Its neighbours' `bad_value` reports come first; its own `NonFiniteLoss` follows within
    the hold and is the root cause: retrying would diverge again."""
    async def body(h: Harness) -> None:
        await h.running_epoch(1)
        h.report("agent-0", WorkerState.FAILED, error=BAD.replace("-12.5", "inf"),
                 error_kind="bad_value")
        await asyncio.sleep(0.05)
        h.report("agent-1", WorkerState.FAILED, error_kind="config",
                 error="NonFiniteLoss: the gradient norm of step 3 is inf (loss 2.1)")
        await until(lambda: h.job.state == FAILED)
        assert "NonFiniteLoss" in h.job.message and RECOVERING not in h.job.entered
    run(config(max_restarts=3), body)
