"""What the coordinator must not forget when it restarts: the job it was driving.

A coordinator that dies mid-job used to come back with a new job id, so the agents'
checkpoints (keyed by job id) were strangers to it and training started again from step 0.
With `coordinator start --state-dir DIR` the job's identity and progress live in
`DIR/coordinator.db` (sqlite3, one row per job, each write one transaction, so a kill at any
instant leaves the previous snapshot or the new one, never half of each). On start the
coordinator adopts the stored job when it was started with the same job flags (the same
fingerprint) and had not finished; otherwise it starts a new job and says why.

A save that fails (a full disk) must not stop training, but it must not go unseen either: the
store counts failed saves in a row and keeps the newest error and the time of the last save
that worked (`failures`, `last_error`, `saved_unix_s`), which `coordinator status` and the
metrics show, since a restart would adopt the older state that was saved.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# the one rule of job identity, shared with agent local (dtfm.core.fingerprint)
from dtfm.core.fingerprint import fingerprint as fingerprint

log = logging.getLogger(__name__)

DB_NAME = "coordinator.db"
SCHEMA = """
CREATE TABLE IF NOT EXISTS job (
    job_id TEXT PRIMARY KEY,
    fingerprint TEXT NOT NULL,
    finished INTEGER NOT NULL DEFAULT 0,
    updated_unix_s REAL NOT NULL,
    snapshot TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS queue (
    job_id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    args TEXT NOT NULL,
    submitted_unix_s REAL NOT NULL
)
"""


@dataclass
class JobSnapshot:
    """The job's durable state; everything else (progress, step times) is rebuilt from the
    agents' next reports."""

    job_id: str
    fingerprint: str
    state: str = "waiting"
    epoch: int = 0
    restarts: int = 0
    members: list[str] = field(default_factory=list)
    grid: list[list[str]] = field(default_factory=list)  # stage x replica -> agent id
    splits: list[int] = field(default_factory=list)  # this epoch's layers per stage
    checkpoint_splits: list[int] = field(default_factory=list)  # the newest checkpoint's
    micro_batches: int = 0  # this epoch's (more per replica while shrunk)
    wanted_replicas: int = 0  # the layout the job grows back to
    wanted_stages: int = 0  # (0: as many as the grid has)
    checkpoint_step: int = 0  # newest step every stage holds intact on some agent
    recoveries: list[dict[str, Any]] = field(default_factory=list)  # Recovery messages as JSON
    replans: list[dict[str, Any]] = field(default_factory=list)  # Replan messages as JSON
    links: dict[str, Any] = field(default_factory=dict)  # the members' measured matrix
    started_unix_s: float = 0.0
    sync_every: int = 0  # `--sync-every auto`: the H chosen on the first plan (0: not yet)
    # pairs whose connection failed, and what was tried (coordinator/job/failedpairs.py)
    failed_pairs: list[dict[str, Any]] = field(default_factory=list)
    # evidence against agents, exclusions and the rollback bound (coordinator/integrity/)
    integrity: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> JobSnapshot:
        raw: dict[str, Any] = json.loads(text)
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in raw.items() if k in known})


class JobStore:
    """One sqlite database in the coordinator's state directory."""

    def __init__(self, state_dir: str | Path) -> None:
        self.path = Path(state_dir) / DB_NAME
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._db = sqlite3.connect(self.path, isolation_level=None, timeout=10)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise OSError(f"--state-dir {state_dir}: cannot open {self.path}: {exc}; give a "
                          f"writable directory on local disk") from exc
        os.chmod(self.path, 0o600)
        self.failures = 0  # saves failed in a row
        self.last_error = ""  # the newest failure ("" once a save works again)
        self.saved_unix_s = 0.0  # the last save that worked

    def save(self, snap: JobSnapshot, finished: bool = False) -> None:
        """Write `snap` (`write`), counting the outcome; raises what the write raised."""
        try:
            self.write(snap, finished)
        except Exception as exc:
            self.failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"[:500]
            raise
        self.failures, self.last_error, self.saved_unix_s = 0, "", time.time()

    def write(self, snap: JobSnapshot, finished: bool = False) -> None:
        """The write itself (the seam a test overrides to fail saves)."""
        with self._db:  # one transaction: the old row or the new, never half
            self._db.execute(
                "INSERT INTO job (job_id, fingerprint, finished, updated_unix_s, snapshot) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT(job_id) DO UPDATE SET "
                "fingerprint=excluded.fingerprint, finished=excluded.finished, "
                "updated_unix_s=excluded.updated_unix_s, snapshot=excluded.snapshot",
                (snap.job_id, snap.fingerprint, int(finished), time.time(), snap.to_json()))

    def unfinished(self, fp: str) -> JobSnapshot | None:
        """The newest unfinished job started with the same flags, if any."""
        rows = self._db.execute(
            "SELECT fingerprint, snapshot FROM job WHERE finished = 0 "
            "ORDER BY updated_unix_s DESC").fetchall()
        for row_fp, text in rows:
            if row_fp == fp:
                return JobSnapshot.from_json(text)
            log.info("state dir %s holds an unfinished job with other flags; not adopting it",
                     self.path.parent)
        return None

    def unfinished_job(self, job_id: str) -> JobSnapshot | None:
        """The unfinished job of this id, if the state directory holds it."""
        row = self._db.execute("SELECT snapshot FROM job WHERE finished = 0 AND job_id = ?",
                               (job_id,)).fetchone()
        return JobSnapshot.from_json(row[0]) if row else None

    # --- submitted jobs (coordinator/daemon/jobs.py): queued or running, until they end ---
    def queue_put(self, job_id: str, seq: int, args: list[str], submitted_unix_s: float
                  ) -> None:
        with self._db:
            self._db.execute("INSERT OR REPLACE INTO queue VALUES (?, ?, ?, ?)",
                             (job_id, seq, json.dumps(args), submitted_unix_s))

    def queue_remove(self, job_id: str) -> None:
        with self._db:
            self._db.execute("DELETE FROM queue WHERE job_id = ?", (job_id,))

    def queue_rows(self) -> list[tuple[str, int, list[str], float]]:
        """(job_id, seq, args, submitted_unix_s) of every submitted job not ended, in order."""
        rows = self._db.execute(
            "SELECT job_id, seq, args, submitted_unix_s FROM queue ORDER BY seq").fetchall()
        return [(job_id, seq, json.loads(args), at) for job_id, seq, args, at in rows]

    def close(self) -> None:
        self._db.close()
