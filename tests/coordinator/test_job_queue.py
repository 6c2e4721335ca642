"""The queue of submitted jobs (coordinator/daemon/jobs.py) and what a submission may say
(coordinator/jobflags.py): order, bounds, cancel, the state directory, the flags' messages."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from coordinator.daemon.jobs import HISTORIES_KEPT, MAX_ENDED, Archive, JobQueue, QueueFull
from coordinator.daemon.jobstore import JobStore
from coordinator.jobflags import (
    MAX_ARG_BYTES,
    MAX_ARGS,
    job_parser,
    parse_submitted,
    toml_args,
)
from dtfm.rpc import ConfigError
from protos.dtfm.v1 import coordinator_pb2

JOB = ["--model", "gpt-tiny", "--agents", "2", "--steps", "3"]


def test_jobs_come_out_in_the_order_submitted_and_a_cancelled_one_never() -> None:
    queue = JobQueue()
    a, b, c = (queue.submit([*JOB, "--seed", str(i)]) for i in range(3))
    assert len({a.job_id, b.job_id, c.job_id}) == 3
    assert [queue.position(j.job_id) for j in (a, b, c)] == [0, 1, 2]
    assert queue.cancel(b.job_id) is b and queue.cancel(b.job_id) is None
    assert asyncio.run(queue.next()) is a and queue.running == {a.job_id: a}
    assert queue.position(c.job_id) == 0  # first in the queue, behind the running one
    queue.ended(a.job_id)
    assert asyncio.run(queue.next()) is c and c.config.seed == 2


def test_next_waits_for_a_submission() -> None:
    async def scenario() -> str:
        queue = JobQueue()
        waiter = asyncio.create_task(queue.next())
        await asyncio.sleep(0.01)
        assert not waiter.done()
        job = queue.submit(JOB)
        return (await asyncio.wait_for(waiter, 1)).job_id == job.job_id

    assert asyncio.run(scenario())


def test_the_queue_is_bounded() -> None:
    queue = JobQueue(limit=2)
    queue.submit(JOB)
    queue.submit(JOB)
    with pytest.raises(QueueFull, match="coordinator cancel"):
        queue.submit(JOB)


def test_a_store_keeps_the_queue_and_the_running_job_until_it_ends(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    queue = JobQueue(store)
    a, b = queue.submit(JOB), queue.submit([*JOB, "--steps", "9"])
    asyncio.run(queue.next())  # a runs: its row stays until it ends
    again = JobQueue(JobStore(tmp_path))
    assert [(s.job_id, s.args) for s in again.waiting] == [(a.job_id, a.args),
                                                           (b.job_id, b.args)]
    assert again.waiting[1].config.train.steps == 9
    queue.ended(a.job_id)
    queue.cancel(b.job_id)
    assert JobQueue(JobStore(tmp_path)).waiting == []
    # ids keep growing past a restart's: the order of new submissions stays the order made
    c = again.submit(JOB)
    assert c.seq > b.seq


def test_a_stored_job_that_no_longer_parses_is_dropped(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    store.queue_put("job-old", 1, ["--model", "no-such-preset"], 0.0)
    assert JobQueue(store).waiting == [] and store.queue_rows() == []


@pytest.mark.parametrize(("args", "named"), [
    (["--agents", "2"], "--model"),
    ([*JOB, "--export-dir", "/tmp/x"], "--export-dir"),
    ([*JOB, "--links", "/etc/passwd"], "--links"),
    ([*JOB, "--init-from", "/models/x"], "--init-from"),
    ([*JOB, "--placement", "/etc/plan.json"], "--placement"),
    ([*JOB, "--steps", "many"], "--steps"),
    ([*JOB, "--listen", "0.0.0.0:1"], "--listen"),  # a daemon flag, not the job's
    (["x"] * (MAX_ARGS + 1), str(MAX_ARGS)),
    ([*JOB, "--data", "d" * (MAX_ARG_BYTES + 1)], str(MAX_ARG_BYTES)),
])
def test_a_bad_submission_names_what_is_wrong(args: list[str], named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        parse_submitted(args)


def test_a_toml_file_stands_for_its_flags_and_the_command_line_wins(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text('model = "gpt-tiny"\nagents = 2\nsteps = 5\nno-measure = true\n'
                    'no_replan = false\nlr = 0.001\n')
    words = toml_args(str(path), job_parser())
    assert words == ["--model", "gpt-tiny", "--agents", "2", "--steps", "5", "--no-measure",
                     "--lr", "0.001"]
    config = parse_submitted([*words, "--steps", "7"])
    assert (config.train.steps, config.measure_links, config.agents) == (7, False, 2)
    path.write_text('model = "gpt-tiny"\nlisten = "x"\n')
    with pytest.raises(ConfigError, match="unknown key 'listen'"):
        toml_args(str(path), job_parser())


def test_the_archive_is_bounded() -> None:
    archive = Archive()
    for i in range(MAX_ENDED + 5):
        archive.add(coordinator_pb2.JobEntry(job_id=f"job-{i}"), lambda *a: None)
    assert len(archive.entries) == MAX_ENDED and len(archive.histories) == HISTORIES_KEPT
    assert archive.entries[-1].job_id == f"job-{MAX_ENDED + 4}"
    assert f"job-{MAX_ENDED + 4}" in archive.histories


def test_submit_sends_the_job_flags_after_the_files_and_keeps_its_own(tmp_path: Path) -> None:
    from coordinator.commands.jobs import client_parser, job_words

    path = tmp_path / "job.toml"
    path.write_text('coordinator = "10.0.0.1:7070"\nmodel = "gpt-tiny"\nagents = 2\n')
    words = job_words(["--coordinator", "127.0.0.1:1", "--config", str(path), "--json",
                       "--steps", "7", "--timeout", "3"], client_parser())
    assert words == ["--model", "gpt-tiny", "--agents", "2", "--steps", "7"]
