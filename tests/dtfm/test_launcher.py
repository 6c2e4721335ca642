"""The one worker launcher and the one progress-event parser.

Unit tests of `dtfm.core.events` (the schema both the worker and its readers use) and of the
progress tail, then real workers started through `dtfm.launcher`: followed to the end from an
event loop, failing with a reason, and stopped (group and all) through `dtfm.procs`.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtfm.core.assignment import build_assignments
from dtfm.core.events import (
    DoneEvent,
    ErrorEvent,
    EventName,
    ProgressEvent,
    StepEvent,
    WorkerEnv,
    encode_event,
    parse_event,
)
from dtfm.core.layout import Layout
from dtfm.core.presets import get_preset
from dtfm.core.spec import TrainConfig
from dtfm.launcher import ProgressTail, WorkerFiles, WorkerProcess, launch, worker_env
from dtfm.procs import terminate_all
from dtfm.rpc import free_port
from protos.dtfm.v1 import common_pb2

REPO = Path(__file__).resolve().parents[2]


# ---- the schema ----

def _step(step: int) -> StepEvent:
    return StepEvent(step=step, loss=4.5, tokens_per_s=1e3, total_steps=9, rank=1, stage=0,
                     replica=1, lr=1e-3, grad_norm=0.7, step_s=0.5, compute_s=0.3,
                     pp_wait_s=0.1, dp_s=0.05, sync_s=0.01, recv_wait_s=0.06,
                     send_wait_s=0.04, stored_peak=2)


def _same(got: list[ProgressEvent | None], want: list[ProgressEvent]) -> bool:
    """Events compared by their wire form: a NaN field ("not reported") never equals itself."""
    return [None if e is None else encode_event(e) for e in got] == [
        encode_event(e) for e in want]


@pytest.mark.parametrize("event", [
    _step(3),
    DoneEvent(val_loss=3.25, rank=2),
    DoneEvent(val_loss=None, rank=0),
    ErrorEvent(message="RuntimeError: boom", rank=1, kind="peer", phase="train"),
])
def test_events_round_trip(event: ProgressEvent) -> None:
    line = encode_event(event)
    obj = json.loads(line)
    assert next(iter(obj)) == "event" and obj["event"] == event.NAME == event.NAME.value
    assert _same([parse_event(line), parse_event(line.encode())], [event, event])


def test_the_wire_form_is_what_readers_grep_for() -> None:
    # tests/system/test_end_to_end.py and bench/runtime.py read progress files as text
    line = encode_event(StepEvent(step=1, loss=2.0))
    assert '"event": "step"' in line and "\n" not in line
    assert {e.value for e in EventName} == {"step", "eval", "done", "error", "integrity"}


def test_a_nan_loss_survives_the_trip() -> None:
    ev = parse_event(encode_event(StepEvent(step=1, loss=math.nan)))
    assert isinstance(ev, StepEvent) and math.isnan(ev.loss)


@pytest.mark.parametrize("line", [
    "", "   ", "not json", '{"event": "step", "step": 1', "[1, 2]", "42", "null",
    '{"no_event": 1}', '{"event": "from-a-newer-worker"}', '{"event": ["step"]}',
    b"\xff\xfe\x00", '{"event": null}',
])
def test_garbage_lines_are_skipped_not_raised(line: str | bytes) -> None:
    assert parse_event(line) is None


def test_missing_and_ill_typed_fields_take_their_defaults() -> None:
    ev = parse_event('{"event": "step", "step": "three", "loss": true, "rank": 2.0, '
                     '"tokens_per_s": 7, "extra": {"ignored": 1}}')
    assert isinstance(ev, StepEvent)
    assert (ev.step, ev.rank, ev.tokens_per_s, ev.total_steps) == (0, 2, 7.0, 0)
    assert math.isnan(ev.loss) and math.isnan(ev.step_s)
    err = parse_event('{"event": "error"}')
    assert err == ErrorEvent(message="", rank=-1, kind="internal", phase="")
    assert parse_event('{"event": "done", "val_loss": "high"}') == DoneEvent(val_loss=None)


def test_the_tail_reads_only_complete_lines(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    tail = ProgressTail(path)
    assert tail.read() == []  # no file yet
    one, two = encode_event(_step(1)), encode_event(_step(2))
    with open(path, "w") as f:
        f.write(one + "\n" + two[:10])
        f.flush()
        assert _same(tail.read(), [_step(1)])
        assert tail.read() == []  # half a line is left for later
        f.write(two[10:] + "\ngarbage\n" + encode_event(DoneEvent(val_loss=1.0)) + "\n")
    assert _same(tail.read(), [_step(2), DoneEvent(val_loss=1.0)])
    assert tail.read() == []


def test_worker_env_says_what_the_worker_needs() -> None:
    env = worker_env(threads=3, timeout_s=30.0, bind_interface="eth1", local_rank=1,
                     base={"PATH": "/bin", WorkerEnv.THREADS: "99"})
    assert env == {
        "PATH": "/bin", "PYTHONUNBUFFERED": "1", WorkerEnv.SUPERVISOR_PID: str(os.getpid()),
        "OMP_NUM_THREADS": "3", "DTFM_NUM_THREADS": "3", "DTFM_TIMEOUT_S": "30.0",
        "DTFM_BIND_INTERFACE": "eth1", "LOCAL_RANK": "1",
    }
    plain = worker_env(base={})
    assert set(plain) == {"PYTHONUNBUFFERED", "DTFM_SUPERVISOR_PID"}


def test_terminate_all_kills_what_ignores_sigterm() -> None:
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \
           "print('ready', flush=True); time.sleep(60)"
    stubborn = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                start_new_session=True)
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              start_new_session=True)
    try:
        assert stubborn.stdout is not None and stubborn.stdout.readline() == b"ready\n"
        t0 = time.monotonic()
        killed = terminate_all([stubborn, polite], grace_s=1.0)
        assert killed == [stubborn] and time.monotonic() - t0 < 10
        assert stubborn.returncode == -signal.SIGKILL
        assert polite.returncode == -signal.SIGTERM
    finally:
        for p in (stubborn, polite):
            if p.poll() is None:
                p.kill()
                p.wait()
        if stubborn.stdout is not None:
            stubborn.stdout.close()


# ---- real workers ----

def _assignment(steps: int = 3, **changes: int) -> common_pb2.Assignment:
    train = TrainConfig(global_batch=4, micro_batches=2, steps=steps, eval_batches=1)
    (msg,) = build_assignments(job_id="t", epoch=0, layout=Layout(1, 1),
                               spec=get_preset("gpt-tiny"), train=train,
                               master_addr="127.0.0.1", master_port=free_port())
    for k, v in changes.items():
        setattr(msg, k, v)
    return msg


def _launch(tmp_path: Path, msg: common_pb2.Assignment, **env: str) -> WorkerProcess:
    base = {**os.environ, "DTFM_LOG_LEVEL": "WARNING", **env}
    return launch(msg, WorkerFiles.in_dir(tmp_path, "r0"),
                  worker_env(threads=1, timeout_s=30.0, base=base), cwd=REPO)


async def _follow(worker: WorkerProcess) -> list[ProgressEvent]:
    return [ev async for ev in worker.follow(poll_s=0.05)]


@pytest.mark.timeout(120)
def test_a_launched_worker_is_followed_to_the_end(tmp_path: Path) -> None:
    worker = _launch(tmp_path, _assignment(steps=3))
    try:
        events = asyncio.run(asyncio.wait_for(_follow(worker), 100))
    finally:
        worker.stop(grace_s=1.0)
    assert worker.returncode == 0, worker.log_tail(20, sep="\n")
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert [e.step for e in steps] == [1, 2, 3]
    assert all(e.total_steps == 3 and e.rank == 0 and e.tokens_per_s > 0 for e in steps)
    assert isinstance(events[-1], DoneEvent) and (events[-1].val_loss or 0) > 0
    for path in (worker.files.assignment, worker.files.log):  # the assignment names a port
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert worker.read_events() == []  # everything was read once


@pytest.mark.timeout(120)
def test_a_failing_worker_says_why(tmp_path: Path) -> None:
    worker = _launch(tmp_path, _assignment(layer_end=3))
    events = asyncio.run(asyncio.wait_for(_follow(worker), 100))
    assert worker.returncode == 1
    (err,) = events
    assert isinstance(err, ErrorEvent) and "layer range" in err.message and err.kind == "config"
    assert "layer range" in worker.log_tail(5)


@pytest.mark.timeout(120)
def test_stop_ends_a_hung_worker_and_its_group(tmp_path: Path) -> None:
    worker = _launch(tmp_path, _assignment(steps=100), DTFM_FAULT="0:2:hang")
    try:
        deadline = time.monotonic() + 90
        seen: list[ProgressEvent] = []
        while not seen and time.monotonic() < deadline and worker.poll() is None:
            seen += worker.read_events()
            time.sleep(0.1)
        assert [e.step for e in seen if isinstance(e, StepEvent)] == [1]
        assert os.getpgid(worker.pid) == worker.pid  # its own session and group
        t0 = time.monotonic()
        asyncio.run(worker.stop_async(grace_s=5.0))
        assert worker.returncode is not None and time.monotonic() - t0 < 10
        with pytest.raises(ProcessLookupError):
            os.killpg(worker.pid, 0)  # nothing of its group is left
    finally:
        worker.stop(grace_s=1.0)
