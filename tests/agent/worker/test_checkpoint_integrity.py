"""Checkpoints that are damaged, that cannot be written, or that belong to another job.

Each defect was found by trying it (loopback, gpt-tiny): a truncated newest checkpoint failed
the job after every restart; a full disk failed it with torch's "enforce fail ... unexpected
pos" and no word of ENOSPC; a new job pointed at a finished job's directory reported done at
step 0. The multi-process tests run real workers over gloo; the full disk is simulated inside
one process, at the writer torch.save writes through.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from agent.worker import checkpoint, errors
from agent.worker.train import run_assignment
from dtfm.core.assignment import build_assignments
from dtfm.core.events import WorkerEnv
from dtfm.core.layout import Layout
from dtfm.core.presets import get_preset
from dtfm.core.spec import TrainConfig
from dtfm.rpc import free_port
from protos.dtfm.v1 import common_pb2
from tests.agent.worker.testlib import REPO, assert_close, local_job_dir, run_local

# ---- units: verification, agreement, pruning, keys ----


def _save(root: Path, stage: int, step: int, job: str = "j", layers: tuple[int, int] = (0, 2),
          ) -> Path:
    return checkpoint.save_stage(root, stage, step, {"x": torch.arange(1000.0) + step},
                                 job_id=job, layers=layers)


def test_a_damaged_checkpoint_fails_verification_with_the_reason(tmp_path: Path) -> None:
    for step in (2, 4):
        _save(tmp_path, 0, step)
    assert checkpoint.verify(tmp_path, 0, 4, job_id="j", layers=(0, 2)) is None
    path = checkpoint.path_for(tmp_path, 0, 4)
    data = path.read_bytes()

    path.write_bytes(data[: len(data) // 2])
    assert "truncated" in (checkpoint.verify(tmp_path, 0, 4) or "")
    path.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])  # one flipped bit
    assert "checksum" in (checkpoint.verify(tmp_path, 0, 4) or "")
    path.write_bytes(data)
    assert "job 'j'" in (checkpoint.verify(tmp_path, 0, 4, job_id="other") or "")
    assert "layers [0, 2)" in (checkpoint.verify(tmp_path, 0, 4, layers=(0, 3)) or "")
    checkpoint.manifest_for(tmp_path, 0, 4).unlink()
    assert "no manifest" in (checkpoint.verify(tmp_path, 0, 4) or "")
    with pytest.raises(errors.CorruptCheckpoint, match="step-00000004.pt was not loaded"):
        checkpoint.load_stage(tmp_path, 0, 4)

    rejected: list[tuple[int, str]] = []
    finder = checkpoint.Finder(tmp_path, 0, job_id="j", layers=(0, 2),
                               on_reject=lambda step, p, why: rejected.append((step, why)))
    assert finder.newest_intact() == 2
    assert finder.newest_intact() == 2  # verdicts are cached: one report per file
    assert [s for s, _ in rejected] == [4]
    assert checkpoint.load_stage(tmp_path, 0, 2, job_id="j")["x"][0].item() == 2.0


class _World:
    """`world_min` for ranks that are threads: a barrier-synchronised minimum."""

    def __init__(self, n: int) -> None:
        self.values: dict[int, int] = {}
        self.barrier = threading.Barrier(n, timeout=10)

    def world_min(self, rank: int, value: int) -> int:
        self.values[rank] = value
        self.barrier.wait()
        low = min(self.values.values())
        self.barrier.wait()
        return low


@pytest.mark.parametrize("intact, agreed", [
    ({0: [2, 4, 8], 1: [2, 4, 8]}, 8),
    ({0: [4, 8], 1: [4]}, 4),  # stage 1's step 8 is damaged: both load step 4
    ({0: [2, 4, 8], 1: [2, 6, 8]}, 8),
    ({0: [2, 4], 1: [2, 6]}, 2),  # newest common step, not min(4, 6)
    ({0: [2, 4, 10], 1: [2, 6, 8], 2: [2, 8, 10]}, 2),
    ({0: [6], 1: []}, 0),
])
def test_ranks_agree_on_the_newest_step_every_one_holds_intact(
    intact: dict[int, list[int]], agreed: int
) -> None:
    class Fake(checkpoint.Finder):
        def __init__(self, steps: list[int]) -> None:
            self.good = steps

        def newest_intact(self, at_most: int | None = None) -> int:
            return max([s for s in self.good if at_most is None or s <= at_most], default=0)

    world, out = _World(len(intact)), {}

    def rank(r: int) -> None:
        out[r] = checkpoint.agree(Fake(intact[r]), lambda v: world.world_min(r, v))

    threads = [threading.Thread(target=rank, args=(r,)) for r in intact]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert out == {r: agreed for r in intact}


def test_pruning_keeps_the_newest_complete_steps_and_drops_an_abandoned_future(
    tmp_path: Path,
) -> None:
    for step in (2, 4, 6, 8):
        _save(tmp_path, 0, step)
    assert checkpoint.steps_available(tmp_path, 0) == [6, 8]
    checkpoint.manifest_for(tmp_path, 0, 8).unlink()  # step 8's write "did not finish"
    stale = checkpoint.stage_dir(tmp_path, 0) / ".step-00000008.pt.tmp.1.abcd"
    stale.write_bytes(b"half")
    # the job resumed from 6 and now writes 7: 6 and 7 stay, 8 (newer, unfinished) goes
    _save(tmp_path, 0, 7)
    assert checkpoint.steps_available(tmp_path, 0) == [6, 7]
    assert not stale.exists()


def test_checkpoints_are_keyed_by_job_and_other_jobs_are_named(tmp_path: Path) -> None:
    assert checkpoint.job_key("job-1a2b3c4d") == "job-1a2b3c4d"
    assert checkpoint.job_key("../../etc") != "../../etc"
    assert "/" not in checkpoint.job_key("a/b")
    _save(checkpoint.job_dir(tmp_path, "job-a"), 0, 2, job="job-a")
    (tmp_path / "stage-0").mkdir()  # the layout before checkpoints were keyed by job
    assert sorted(checkpoint.other_jobs(tmp_path, "job-b")) == ["(unkeyed)", "job-a"]
    assert checkpoint.other_jobs(tmp_path, "job-a") == ["(unkeyed)"]


def test_checkpoints_are_on_by_default_in_the_agents_dir_and_off_at_zero(tmp_path: Path) -> None:
    assert TrainConfig().checkpoint_every > 0
    env = {WorkerEnv.AGENT_CHECKPOINT_DIR.value: str(tmp_path / "own")}
    own = checkpoint.locate("", "job-a", 50, env)
    assert own is not None and own.own and own.dir == tmp_path / "own" / "job-a"
    assert own.writes(1)  # the agent's own disk: every replica keeps its stage
    shared = checkpoint.locate(str(tmp_path / "shared"), "job-a", 50, env)
    assert shared is not None and not shared.own and not shared.writes(1) and shared.writes(0)
    assert checkpoint.locate(str(tmp_path), "job-a", 0, env) is None
    assert checkpoint.locate("", "job-a", 50, {}) is None
    assert own.due(50, 120) and own.due(120, 120) and not own.due(60, 120)


# ---- a full disk: the reported error names ENOSPC and the file ----


class _FillingFile:
    """A file on a disk that fills up after `limit` bytes: writes past it fail with ENOSPC
    (without a file name, as a real buffered write's error has none)."""

    def __init__(self, f: Any, limit: int) -> None:
        self._f, self._left = f, limit

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        if n > self._left:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._left -= n
        return int(self._f.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _FillingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()


def _disk_fills_after(monkeypatch: pytest.MonkeyPatch, under: Path, limit: int) -> None:
    """Files opened under `under` (through os.fdopen, as checkpoint writes are) fill the
    disk after `limit` bytes; everything else is untouched."""
    real = os.fdopen

    def fdopen(fd: int, *args: Any, **kwargs: Any) -> Any:
        f = real(fd, *args, **kwargs)
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(under)):
            return _FillingFile(f, limit)
        return f

    monkeypatch.setattr(os, "fdopen", fdopen)


def test_a_full_disk_reports_enospc_and_the_file_and_keeps_the_old_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(tmp_path, 0, 2)
    _disk_fills_after(monkeypatch, tmp_path, 1000)
    with pytest.raises(errors.StorageError) as info:
        _save(tmp_path, 0, 4)
    message = errors.describe(info.value)
    assert "No space left on device" in message
    assert str(checkpoint.path_for(tmp_path, 0, 4)) in message
    assert "--checkpoint-every 0" in message  # says what to do
    assert errors.classify(info.value, errors.TRAIN) == errors.CONFIG
    # the chain still holds torch's wrapper and the OSError beneath it
    assert isinstance(errors.os_error_in(info.value), OSError)
    # nothing half-written stays; the previous step is intact
    names = sorted(p.name for p in checkpoint.stage_dir(tmp_path, 0).iterdir())
    assert names == ["step-00000002.manifest.json", "step-00000002.pt"]
    assert checkpoint.verify(tmp_path, 0, 2, job_id="j") is None


def test_describe_follows_implicit_and_explicit_causes() -> None:
    caught: list[BaseException] = []
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/ckpt/x.pt")
        except OSError:  # an implicit chain (__context__), as torch.save leaves it
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")  # noqa: B904
    except RuntimeError as e:
        caught.append(e)
    text = errors.describe(caught[0])
    assert text.startswith("RuntimeError: [enforce fail")
    assert "caused by OSError: [Errno 28] No space left on device: '/ckpt/x.pt'" in text
    assert errors.classify(caught[0], errors.TRAIN) == errors.CONFIG
    explicit = ValueError("outer")
    explicit.__cause__ = KeyError("inner")
    assert errors.describe(explicit) == "ValueError: outer; caused by KeyError: 'inner'"


def test_the_worker_reports_a_full_disk_with_its_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`run_assignment`'s error event: the message a supervisor forwards to the coordinator."""
    (msg,) = _assignments("job-a", 0, steps=2, checkpoint_dir=str(tmp_path / "ckpt"))
    target = checkpoint.path_for(checkpoint.job_dir(tmp_path / "ckpt", "job-a"), 0, 2)

    def run(self: Any) -> None:  # what Worker._save does at step 2, minus the training
        checkpoint.save_stage(target.parent.parent, 0, 2, {"x": torch.zeros(10_000)})

    from agent.worker import train

    monkeypatch.setattr(train.Worker, "run", run)
    _disk_fills_after(monkeypatch, tmp_path / "ckpt", 1000)
    progress = tmp_path / "progress.jsonl"
    with pytest.raises(errors.StorageError):
        run_assignment(msg, str(progress))
    event = json.loads(progress.read_text().splitlines()[-1])
    assert event["event"] == "error" and event["kind"] == "config", event
    assert "No space left on device" in event["message"], event
    assert str(target) in event["message"], event
    assert "caused by" in event["message"], event


# ---- real workers ----

FLAGS = ("--model", "gpt-tiny", "--stages", "2", "--replicas", "1", "--batch", "4",
         "--micro-batches", "2", "--steps", "8", "--checkpoint-every", "4", "--seed", "5",
         "--eval-batches", "1", "--timeout", "30")


def _logs(workdir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(workdir.glob("*.log")))


@pytest.mark.timeout(150)
def test_a_truncated_newest_checkpoint_resumes_from_the_previous_good_step(
    tmp_path: Path,
) -> None:
    ckpt = tmp_path / "ckpt"
    full = run_local(*FLAGS, "--checkpoint-dir", str(ckpt))
    assert full.rc == 0, full.stderr
    # the finished job left steps 4 and 8 in both stages; cut stage 1's step 8 in half, as a
    # disk that filled up during a copy would
    newest = checkpoint.path_for(local_job_dir(ckpt), 1, 8)
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])

    work = tmp_path / "work"
    again = run_local(*FLAGS, "--checkpoint-dir", str(ckpt), "--workdir", str(work))
    assert again.rc == 0, again.stderr + _logs(work)
    # stage 0 still holds step 8 intact, but stage 1 does not: both resume from step 4
    assert [s["step"] for s in again.steps] == [5, 6, 7, 8]
    assert_close(again.losses, full.losses[4:], 1e-6)
    logs = _logs(work)
    assert f"checkpoint {newest} (step 8) is not used" in logs, logs
    assert "truncated" in logs, logs


def _assignments(job: str, epoch: int, steps: int, checkpoint_dir: str = "",
                 every: int = 2) -> list[common_pb2.Assignment]:
    train = TrainConfig(global_batch=2, micro_batches=1, steps=steps, eval_batches=0,
                        checkpoint_dir=checkpoint_dir, checkpoint_every=every)
    return build_assignments(job_id=job, epoch=epoch, layout=Layout(1, 1),
                             spec=get_preset("gpt-tiny"), train=train,
                             master_addr="127.0.0.1", master_port=free_port())


def _run_worker(tmp_path: Path, name: str, msg: common_pb2.Assignment,
                **env: str) -> tuple[int, list[int], str]:
    """One real `python -m agent.worker`: exit code, steps it trained, its stderr."""
    spec, progress = tmp_path / f"{name}.pb", tmp_path / f"{name}.jsonl"
    spec.write_bytes(msg.SerializeToString())
    full = {k: v for k, v in os.environ.items() if k != WorkerEnv.AGENT_CHECKPOINT_DIR}
    full.update({"DTFM_NUM_THREADS": "1", "DTFM_TIMEOUT_S": "30", **env})
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.worker", "--assignment", str(spec), "--progress",
         str(progress)], cwd=REPO, env=full, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True)
    try:
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    events = [json.loads(line) for line in progress.read_text().splitlines()] \
        if progress.exists() else []
    return proc.returncode, [e["step"] for e in events if e["event"] == "step"], err


@pytest.mark.timeout(240)
def test_a_new_job_ignores_an_old_jobs_checkpoints_and_a_recovering_job_resumes(
    tmp_path: Path,
) -> None:
    ckpt = str(tmp_path / "ckpt")
    # job-a crashes before step 4, after checkpointing step 2
    rc, steps, err = _run_worker(tmp_path, "a0", _assignments("job-a", 0, 4, ckpt)[0],
                                 DTFM_FAULT="0:4")
    assert rc == 17 and steps == [1, 2, 3], err
    # a new job in the same directory trains from step 1, and says what it left alone
    rc, steps, err = _run_worker(tmp_path, "b0", _assignments("job-b", 0, 4, ckpt)[0])
    assert rc == 0 and steps == [1, 2, 3, 4], err
    assert "ignoring checkpoints of other jobs" in err and "job-a" in err, err
    # job-a, rescheduled (epoch 1), resumes from its own step 2
    rc, steps, err = _run_worker(tmp_path, "a1", _assignments("job-a", 1, 4, ckpt)[0])
    assert rc == 0 and steps == [3, 4], err


@pytest.mark.timeout(120)
def test_without_a_checkpoint_dir_the_worker_checkpoints_where_its_agent_says(
    tmp_path: Path,
) -> None:
    own = tmp_path / "state" / "checkpoints"
    msg = _assignments("job-a", 0, 3, every=TrainConfig().checkpoint_every)[0]
    rc, steps, err = _run_worker(tmp_path, "a0", msg,
                                 **{WorkerEnv.AGENT_CHECKPOINT_DIR.value: str(own)})
    assert rc == 0 and steps == [1, 2, 3], err
    # fewer steps than the default interval: only the final checkpoint, with its manifest
    assert checkpoint.steps_available(own / "job-a", 0) == [3]
    assert checkpoint.verify(own / "job-a", 0, 3, job_id="job-a") is None
