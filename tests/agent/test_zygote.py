"""A warm spare forks each assignment's worker and stays (agent/worker/zygote.py, dtfm/forked.py).

Real processes: the supervisor's spare is `python -m agent.worker --spare --reply-fd N`, the
jobs one-rank gloo worlds. What is pinned: once warm, the spare forks the worker (another
pid, in a session of its own, its output in the assignment's log) and is still there for the
next assignment, which it forks too; a forked worker's crash is reported with its exit code
and log; a reassignment kills a forked worker; a forked worker dies with its zygote and the
supervisor reports it; the protocol's bad lines are refused.
"""

from __future__ import annotations

import os
import queue
import signal
from pathlib import Path

import pytest

from agent.daemon.supervisor import Supervisor
from agent.worker.zygote import ZygoteError, exit_code, parse_request, serve
from dtfm.core.workerstate import WorkerState
from dtfm.forked import Replies
from tests.agent.test_prewarm import ENDED, alive, assignment, run, startup_line, until


@pytest.fixture(autouse=True)
def _small_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTFM_NUM_THREADS", "1")
    monkeypatch.setenv("DTFM_TIMEOUT_S", "60")
    monkeypatch.delenv("DTFM_FAULT", raising=False)


def test_requests_are_a_list_to_become_or_an_object_to_fork() -> None:
    assert parse_request('["--assignment", "a"]\n') == ("become", ["--assignment", "a"])
    assert parse_request('{"fork": ["--assignment", "a"]}') == ("fork", ["--assignment", "a"])
    for bad in ("", "not json", '{"fork": "x"}', '[1, 2]', '{"spawn": []}', "7"):
        with pytest.raises(ZygoteError, match="a spare expects"):
            parse_request(bad)


def test_exit_statuses_read_as_popen_returncodes() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(17)
    assert exit_code(os.waitpid(pid, 0)[1]) == 17
    pid = os.fork()
    if pid == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    assert exit_code(os.waitpid(pid, 0)[1]) == -signal.SIGKILL


@pytest.mark.timeout(180)
def test_a_warm_spare_forks_each_worker_and_stays(tmp_path: Path) -> None:
    work = tmp_path / "work"

    async def main(sup: Supervisor) -> None:
        await until(lambda: sup.spare_warm, "the spare to be warm")
        zygote = sup.spare_pid
        assert zygote is not None
        pids = []
        for job in ("job-a", "job-b"):
            a = assignment(job, steps=2)
            await sup.start(a)
            await until(lambda: sup.progress.state in ENDED, f"{job} to end")
            assert sup.progress.state == WorkerState.DONE, sup.progress.error
            marks = startup_line(work, a)  # the child's output is in the assignment's log
            assert marks["spare"] is True and marks["pid"] not in (zygote, *pids)
            pids.append(marks["pid"])
            assert sup.spare_pid == zygote and alive(zygote)  # it stayed
        assert not any(alive(p) for p in pids)  # reaped, and reported as done

    run(main, work)


@pytest.mark.timeout(180)
def test_a_forked_workers_crash_is_reported_with_its_code_and_log(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTFM_FAULT", "0:2")  # rank 0 exits with code 17 before step 2

    async def main(sup: Supervisor) -> None:
        await until(lambda: sup.spare_warm, "the spare to be warm")
        zygote = sup.spare_pid
        await sup.start(assignment("job-crash", steps=5))
        await until(lambda: sup.progress.state in ENDED, "the worker to fail")
        assert sup.progress.state == WorkerState.FAILED
        assert "exited with code 17" in sup.progress.error, sup.progress.error
        assert "fault injection" in sup.progress.error  # the tail of the assignment's log
        assert sup.spare_pid == zygote

    run(main, tmp_path / "work")


@pytest.mark.timeout(180)
def test_a_reassignment_kills_a_forked_worker(tmp_path: Path) -> None:
    async def main(sup: Supervisor) -> None:
        await until(lambda: sup.spare_warm, "the spare to be warm")
        a = assignment("job-long", steps=100_000)
        await sup.start(a)
        await until(lambda: sup.progress.step >= 1, "the first step")
        long_pid = startup_line(tmp_path / "work", a)["pid"]
        assert os.getpgid(long_pid) == long_pid  # a session of its own: stops kill its group
        await sup.start(assignment("job-next", steps=1))
        assert not alive(long_pid)  # stop() ended and reaped it before the next one started
        await until(lambda: sup.progress.state in ENDED, "the next job to end")
        assert sup.progress.state == WorkerState.DONE and sup.progress.job_id == "job-next"

    run(main, tmp_path / "work")


@pytest.mark.timeout(180)
def test_a_forked_worker_dies_with_its_zygote_and_is_reported(tmp_path: Path) -> None:
    async def main(sup: Supervisor) -> None:
        await until(lambda: sup.spare_warm, "the spare to be warm")
        zygote = sup.spare_pid
        assert zygote is not None
        a = assignment("job-orphan", steps=100_000)
        await sup.start(a)
        await until(lambda: sup.progress.step >= 1, "the first step")
        child = startup_line(tmp_path / "work", a)["pid"]
        os.kill(zygote, signal.SIGKILL)
        await until(lambda: sup.progress.state in ENDED, "the orphaned worker to be reported")
        assert sup.progress.state == WorkerState.FAILED
        assert "signal 9" in sup.progress.error or "-9" in sup.progress.error, \
            sup.progress.error
        assert not alive(child)

    run(main, tmp_path / "work")


def test_a_refused_fork_is_answered_in_order_and_its_reason_kept() -> None:
    read, write = os.pipe()
    replies = Replies(read)
    replies.start()
    lines: queue.Queue[str] = queue.Queue()
    lines.put('{"fork": ["--assignment", "a"]}\n')
    lines.put("")  # end of input: the zygote ends
    assert serve(lines, write, fork_problem=lambda: "CUDA is\ninitialized") is None
    os.close(write)
    assert replies.next_pid(timeout=5) is None
    assert replies.refusal == "CUDA is initialized"
    replies.join(timeout=5)
    assert replies.ended


@pytest.mark.timeout(180)
def test_a_spare_that_refuses_to_fork_becomes_its_worker_and_so_do_the_next(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTFM_FORK_WORKERS", "0")
    work = tmp_path / "work"

    async def main(sup: Supervisor) -> None:
        await until(lambda: sup.spare_warm, "the spare to be warm")
        for job in ("job-a", "job-b"):
            spare = sup.spare_pid
            a = assignment(job, steps=1)
            await sup.start(a)
            await until(lambda: sup.progress.state in ENDED, f"{job} to end")
            assert sup.progress.state == WorkerState.DONE, sup.progress.error
            marks = startup_line(work, a)
            if job == "job-a":  # refused: a fresh worker, and plain spares from now on
                assert marks["spare"] is False and not alive(spare)
            else:  # the plain spare became the worker
                assert marks["spare"] is True and marks["pid"] == spare
            await until(lambda: sup.spare_pid, "the next spare")

    run(main, work)
