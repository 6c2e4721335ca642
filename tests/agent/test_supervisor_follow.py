"""A worker that has already exited may still have events its follower has not read; a new
assignment must not start before them, nor take them as its own. CI once saw a grow-back's
heartbeat carry the new epoch with the old worker's step 35 and resumed step 12, and the
coordinator recorded the recovery as resumed from step 12 (tests/system/test_churn.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

from agent.daemon.supervisor import Supervisor, WorkerProgress
from dtfm.core.events import StepEvent


class ExitedWorker:
    """A worker process that has exited, whose last step events are still being read."""

    pid = 4242
    returncode = -15

    def __init__(self) -> None:
        self.read = asyncio.Event()

    def poll(self) -> int:
        return self.returncode

    async def follow(self) -> AsyncIterator[StepEvent]:
        await asyncio.sleep(0.3)  # the last poll of its progress file
        yield StepEvent(step=35, total_steps=90)
        self.read.set()

    def log_tail(self) -> str:
        return "(stopped)"


def test_stop_waits_for_an_exited_workers_last_events_and_they_stay_its_own(
        tmp_path: Path) -> None:
    async def run() -> None:
        sup = Supervisor(tmp_path / "work")
        old = WorkerProgress(job_id="job", epoch=2)
        sup.progress = old
        worker = ExitedWorker()
        sup._worker = worker  # type: ignore[assignment]
        sup._task = asyncio.create_task(sup._follow(worker))  # type: ignore[arg-type]
        await sup.stop("replaced by a new assignment")
        assert worker.read.is_set(), "stop returned before the worker's last events were read"
        sup.progress = new = WorkerProgress(job_id="job", epoch=3)  # what start() does next
        await asyncio.sleep(0.05)
        assert old.step == 35 and new.step == 0, (old, new)

    asyncio.run(run())
