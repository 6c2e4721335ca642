"""What makes two runs "the same job": the one rule for which checkpoints a run may resume.

A job's checkpoints hold weights, optimizer state and a data position trained under its flags;
a run started with other flags (another model, layout, seed, learning rate, data or step count)
that loaded them would either fail on tensors it lacks, or, worse, carry on from a state it did
not produce and report a finished job without training. So both programs identify a job by a
digest of the flags that must match to resume:

- `coordinator start --state-dir` adopts a stored unfinished job only under the same
  fingerprint (`coordinator.daemon.jobstore`; `coordinator.job.machine.job_fingerprint` names
  the flags);
- `agent local`, which stores nothing but its checkpoints, names its job, and so its folder
  under `--checkpoint-dir`, after the fingerprint (`local_job_id`): a rerun with the same flags
  resumes, a run with other flags starts from step 0 in a folder of its own.

Pure Python (hashlib, json): no torch, no grpc.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dtfm.core.spec import TrainConfig

LOCAL_PREFIX = "local-"  # agent local's job ids: local-<fingerprint>

# Training fields that change what a run reports, not what it trains: a job's fingerprint
# leaves them out, so a restart with another value resumes, and the fingerprints stored before
# they existed still match.
# (`verify` checks without changing the bits, except `robust`'s averaging: a tolerance choice)
REPORTING_ONLY = ("eval_every", "verify")
# Training fields added after jobs were fingerprinted: left out at their default, so those
# jobs' fingerprints still match and a restart resumes them.
LATER_AT_DEFAULT = ("outer_delay", "pipeline_delay")


def fingerprinted(cfg: TrainConfig) -> dict[str, Any]:
    """`cfg`'s fields as a job's fingerprint takes them: all but `REPORTING_ONLY`, and the
    later fields only away from their default."""
    defaults = {f.name: f.default for f in fields(cfg)}
    return {k: v for k, v in asdict(cfg).items() if k not in REPORTING_ONLY
            and not (k in LATER_AT_DEFAULT and v == defaults[k])}


def fingerprint(job_flags: Mapping[str, Any]) -> str:
    """Identifies "the same job": 16 hex digits of the sha256 of `job_flags` as sorted JSON
    (values JSON cannot hold, enums and paths, by their `str`)."""
    text = json.dumps(job_flags, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def local_job_id(job_flags: Mapping[str, Any]) -> str:
    """`agent local`'s job id for a run with these flags: `local-<fingerprint>`."""
    return LOCAL_PREFIX + fingerprint(job_flags)


def is_local_job(job_id: str) -> bool:
    """Whether a checkpoint folder's name is an `agent local` run's (`local` itself: the id
    every local run had before ids carried the fingerprint)."""
    return job_id == "local" or job_id.startswith(LOCAL_PREFIX)
