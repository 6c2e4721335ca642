"""The agent's spare worker: started before any assignment, it takes the next one and trains.

Real processes throughout: the supervisor's spare is `python -m agent.worker --spare`, the
job a one-rank gloo world, the agent a real `agent start` daemon. What is pinned: the spare
imports below the workers' priority, an assignment that finds it importing raises it and
waits, the spare forks the worker (its output in the assignment's log) and stays, a spare
started with another environment is not used, and no spare outlives its agent. The forked
workers' crashes, stops and orphaning are pinned by tests/agent/test_zygote.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from agent.daemon.supervisor import Supervisor
from dtfm.core.assignment import build_assignments
from dtfm.core.layout import Layout
from dtfm.core.presets import get_preset
from dtfm.core.spec import TrainConfig
from dtfm.core.workerstate import WorkerState
from dtfm.rpc import free_port
from protos.dtfm.v1 import common_pb2
from tests.daemons import TOKEN

REPO = Path(__file__).resolve().parents[2]
ENDED = (WorkerState.DONE, WorkerState.FAILED)


@pytest.fixture(autouse=True)
def _small_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTFM_NUM_THREADS", "1")
    monkeypatch.setenv("DTFM_TIMEOUT_S", "60")
    monkeypatch.delenv("DTFM_FAULT", raising=False)


def assignment(job: str, steps: int, **changes: int) -> common_pb2.Assignment:
    train = TrainConfig(global_batch=4, micro_batches=2, steps=steps, eval_batches=0,
                        checkpoint_every=0)
    (msg,) = build_assignments(job_id=job, epoch=0, layout=Layout(1, 1),
                               spec=get_preset("gpt-tiny"), train=train,
                               master_addr="127.0.0.1", master_port=free_port())
    for key, value in changes.items():
        setattr(msg, key, value)
    return msg


def run(main: Callable[[Supervisor], Awaitable[None]], work: Path) -> None:
    """Run `main` with a prewarming supervisor, which is closed (spare included) after."""

    async def go() -> None:
        sup = Supervisor(work, prewarm=True)
        try:
            await main(sup)
        finally:
            await sup.close("test over")

    asyncio.run(go())


async def until(check: Callable[[], Any], what: str, timeout: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        await asyncio.sleep(0.1)
    return got


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def niceness(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def autogroup_nice(pid: int) -> int | None:
    """The niceness of `pid`'s autogroup (None: the kernel has no autogroups)."""
    try:
        return int(Path(f"/proc/{pid}/autogroup").read_text().split("nice")[1])
    except (OSError, IndexError):
        return None


def startup_line(work: Path, a: common_pb2.Assignment) -> dict[str, Any]:
    """The worker's own `start-up:` log line, from the assignment's log."""
    text = (work / f"{a.job_id}-e{a.epoch}-r{a.rank}.log").read_text()
    (line,) = [ln for ln in text.splitlines() if " start-up: " in ln]
    return json.loads(line.split(" start-up: ", 1)[1])


@pytest.mark.timeout(180)
def test_an_assignment_waits_for_the_importing_spare_which_forks_it_and_stays(
        tmp_path: Path) -> None:
    work = tmp_path / "work"

    async def main(sup: Supervisor) -> None:
        spare = sup.spare_pid
        assert spare is not None and alive(spare)
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        if os.geteuid() == 0:  # where it can be raised back: it imports below the workers
            await until(lambda: niceness(spare) == min(19, ours + 10), "the spare's nice")
            # ... in the idle class, so its import takes no CPU time a worker or agent wants
            await until(lambda: os.sched_getscheduler(spare) == os.SCHED_IDLE,
                        "the spare's idle scheduling class")
            # ... and its session's group at the lowest priority, or the kernel's autogroups
            # would share CPU between the spare's session and each agent's as equals
            await until(lambda: autogroup_nice(spare) in (None, 19), "the group's nice")
        a = assignment("job-warm", steps=3)
        await sup.start(a)  # at once: the spare is still importing, and is waited for
        # raised to the agent's priority for the rest of its import, and kept there
        assert niceness(spare) == ours
        assert os.sched_getscheduler(spare) == os.sched_getscheduler(0)
        assert autogroup_nice(spare) in (None, 0)
        await until(lambda: sup.progress.state in ENDED, "the job to end")
        assert sup.progress.state == WorkerState.DONE, sup.progress.error
        assert sup.progress.step == 3 and sup.progress.startup_s > 0
        marks = startup_line(work, a)  # the forked worker's output is in the assignment's log
        assert marks["spare"] is True and marks["pid"] != spare
        assert marks["assigned_at"] <= marks["ready_at"]
        assert marks["imported_at"] <= marks["ready_at"]
        assert sup.spare_pid == spare and alive(spare)  # it stays for the next assignment
        assert not alive(marks["pid"])

    run(main, work)


@pytest.mark.timeout(180)
def test_a_spare_started_with_another_environment_is_not_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work"

    async def main(sup: Supervisor) -> None:
        spare = sup.spare_pid
        assert spare is not None
        monkeypatch.setenv("DTFM_DP_BUCKET_MB", "2")  # the worker would read it: no spare
        a = assignment("job-env", steps=2)
        await sup.start(a)
        await until(lambda: sup.progress.state in ENDED, "the job to end")
        assert sup.progress.state == WorkerState.DONE, sup.progress.error
        marks = startup_line(work, a)
        assert marks["spare"] is False and marks["pid"] != spare
        assert not alive(spare)

    run(main, work)


def _spare_of(agent: int) -> int | None:
    """The pid of `agent`'s spare worker (a child whose command line has --spare)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != agent:
                continue
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if b"--spare" in argv:
            return int(stat.parent.name)
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and PDEATHSIG")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["term", "kill"])
def test_the_spare_dies_with_its_agent(tmp_path: Path, sig: int) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTFM_")}
    env.update(DTFM_TOKEN=TOKEN, PYTHONUNBUFFERED="1")
    # no coordinator listens there: the agent keeps retrying, with its spare waiting
    cmd = [sys.executable, "-m", "agent", "start", "--coordinator",
           f"127.0.0.1:{free_port()}", "--state-dir", str(tmp_path / "state"),
           "--device", "cpu", "--flops", "1e9", "--memory", "1000000000"]
    with open(tmp_path / "agent.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    spare = None
    try:
        deadline = time.monotonic() + 60
        while spare is None and time.monotonic() < deadline and proc.poll() is None:
            spare = _spare_of(proc.pid)
            time.sleep(0.2)
        assert spare is not None, (tmp_path / "agent.log").read_text()
        proc.send_signal(sig)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while alive(spare) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(spare)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if spare is not None and alive(spare):
            os.kill(spare, signal.SIGKILL)
