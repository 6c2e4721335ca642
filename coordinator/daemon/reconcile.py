"""The coordinator's saved state against what the agents report: failed saves, stale snapshots.

With `--state-dir` on a full disk every save of the job's state failed, in the log only; a
restart then adopted the older snapshot that was saved, showed step 0 while the workers trained
on in a newer epoch (their reports name an epoch the adopted job did not know, so they were
dropped), and restarted them when the adoption wait ran out a minute later, into an epoch
number the agents had already used. So:

- the store's failed saves show in `coordinator status` (and `--json`) and the metrics
  (`persistence_fields`, from `JobStore.failures`, `last_error` and `saved_unix_s`);
- an adopted job that hears a member of its own job report a newer epoch than the snapshot
  holds (`stale_snapshot`) trusts the report, not the file: it takes that epoch number (so its
  next epoch is newer than anything the agents ran) and re-plans at once with that reason,
  instead of showing step 0 for the adoption wait. The workers restart from their newest
  checkpoint: a progress report does not say which rank an agent holds, so the newer epoch's
  grid cannot be rebuilt from the reports.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from protos.dtfm.v1 import coordinator_pb2

log = logging.getLogger(__name__)
ADOPT_WAIT_S = 60.0  # how long an adopted job waits for its members to report again


class _Saves(Protocol):
    failures: int
    last_error: str
    saved_unix_s: float


def persistence_fields(store: _Saves | None) -> dict[str, Any]:
    """The JobStatus fields that say how saving the job's state goes ({} without a store)."""
    if store is None:
        return {}
    return {"state_save_failures": store.failures, "state_save_error": store.last_error,
            "state_saved_unix_s": store.saved_unix_s}


def stale_snapshot(job_id: str, epoch: int, report: coordinator_pb2.ProgressReport) -> str:
    """Why the adopted snapshot (`job_id` at `epoch`) is stale by this report ('' if not)."""
    if not job_id or report.job_id != job_id or report.epoch <= epoch:
        return ""
    return (f"the state directory held epoch {epoch}, but {report.agent_id} reports epoch "
            f"{report.epoch} of the job (its saves failed or lagged): re-planning from the "
            f"members' newest checkpoints instead of trusting the stale state")


def adopt_deadline() -> float:
    """When an epoch adopted now gives up on members that have not reported (monotonic)."""
    return time.monotonic() + ADOPT_WAIT_S


def adopted_silence(job_id: str, epoch: int, members: Sequence[str],
                    progress: Mapping[str, object], deadline: float) -> tuple[float, str]:
    """The adoption `deadline` left (0: no longer waiting) and, once it has passed with
    members silent, why the adopted epoch fails ('' otherwise)."""
    if not deadline:
        return 0.0, ""
    silent = [a for a in members if a not in progress]
    if not silent:
        log.info("job %s: every member of epoch %d reported after the restart", job_id, epoch)
        return 0.0, ""
    if time.monotonic() > deadline:
        return 0.0, (f"member(s) {', '.join(silent)} did not report within "
                     f"{ADOPT_WAIT_S:.0f} s of the coordinator's restart")
    return deadline, ""


def save_line(failures: int, error: str, saved_unix_s: float, now_unix_s: float) -> str:
    """A status line about failed saves ('' when the newest save worked)."""
    if not failures:
        return ""
    since = (f"last saved {max(now_unix_s - saved_unix_s, 0):.0f} s ago" if saved_unix_s
             else "never saved")
    return (f"STATE NOT SAVED: {failures} save(s) of the job's state failed in a row ({since}; "
            f"a restart would adopt that older state): {error}")


def shutdown_note(state: str, path: object) -> str:
    """What a coordinator stopping with a state directory leaves behind, for its log: a job
    still under way is left to the next coordinator; a `done` or `failed` one has ended."""
    if state in ("done", "failed", "cancelled"):
        return f"{state}: the job has ended, nothing runs on (its record stays in {path})"
    return f"left running for the next coordinator (state in {path})"
