"""The operator calls (SubmitJob, CancelJob, Admit) need the operator token when the
coordinator has one: the join token is every volunteer's (coordinator/daemon/operator.py).

On the daemon's own service over a real gRPC server, driven by the real `coordinator
submit/cancel/admit` commands: a caller with the join token alone (what every agent holds)
is refused PERMISSION_DENIED, told which flag it lacks, and changes nothing; the operator's
token is let through; without an operator token nothing changes but one warning at start.
No job trains: the served coordinator's scheduler does not run, so a submitted job stays
queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from coordinator.cli import main
from coordinator.daemon.config import CoordinatorConfig, JobConfig
from coordinator.daemon.operator import OPERATOR_ENV, OperatorGate
from coordinator.daemon.server import CoordinatorService
from dtfm import rpc
from protos.dtfm.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.agent.test_checkpoint_transfer import SECURITY
from tests.coordinator.served import served, tiny_config

pytestmark = pytest.mark.timeout(60)
OPERATOR = "operator-token-9876543210"


@contextlib.contextmanager
def serving(config: CoordinatorConfig) -> Iterator[tuple[str, CoordinatorService]]:
    """`served(config)` on a loop of its own in a thread, so the commands (which run their
    own loops) can call it from this one; yields (HOST:PORT, the service), whose agent
    `bad` is excluded for a confirmed fault (in the service's own thread)."""
    loop = asyncio.new_event_loop()
    up: list[tuple[str, CoordinatorService]] = []
    ready, done = threading.Event(), asyncio.Event()

    async def serve() -> None:
        try:
            async with served(config) as answer:
                answer[1].job.integrity.ledger.record("bad", "grad_mismatch", 42, "by 10x",
                                                      confirmed=True)
                up.append(answer)
                ready.set()
                await done.wait()
        finally:
            ready.set()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    try:
        assert ready.wait(20) and up, "the coordinator did not start"
        yield up[0]
    finally:
        loop.call_soon_threadsafe(done.set)
        thread.join(10)
        loop.close()


def config(**fields: Any) -> CoordinatorConfig:
    """The test token and a gpt-tiny job (not started), no state directory (its database is
    the server thread's alone)."""
    return CoordinatorConfig(security=SECURITY, job=JobConfig(model="gpt-tiny", agents=8),
                             **fields)


def secret_file(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The join token's file and the operator token's (and a wrong one); no token from the
    environment."""
    for name in (OPERATOR_ENV, "DTFM_OPERATOR_TOKEN_FILE", "DTFM_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return {"join": secret_file(tmp_path / "token", SECURITY.token),
            "operator": secret_file(tmp_path / "operator", OPERATOR),
            "wrong": secret_file(tmp_path / "wrong", "not-the-operator-token-0000")}


def command(address: str, files: dict[str, str], *words: str,
            operator: str = "") -> list[str]:
    """`coordinator WORDS...` against `address` with the join token (and `operator`'s file)."""
    extra = ["--operator-token-file", files[operator]] if operator else []
    return [words[0], "--coordinator", address, "--token-file", files["join"], *extra,
            *words[1:]]


def refused(capsys: pytest.CaptureFixture[str], rc: int) -> str:
    assert rc == 1
    err = capsys.readouterr().err
    assert "PERMISSION_DENIED" in err, err
    return err


JOB = ("--model", "gpt-tiny", "--agents", "2", "--steps", "5")


def test_the_join_token_alone_cannot_submit_cancel_or_admit_and_the_operator_can(
        tmp_path: Path, files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    with serving(config(operator_token=OPERATOR)) as (address, svc):
        # an agent: what it holds is the join token
        err = refused(capsys, main(command(address, files, "submit", *JOB)))
        assert "--operator-token-file" in err and "SubmitJob is an operator call" in err
        assert not svc.queue.waiting

        # the operator
        assert main(command(address, files, "submit", "--json", *JOB, operator="operator")) == 0
        assert [s.job_id for s in svc.queue.waiting] == [job_id := svc.queue.waiting[0].job_id]
        capsys.readouterr()

        err = refused(capsys, main(command(address, files, "cancel", job_id)))
        assert "CancelJob is an operator call" in err and "--operator-token-file" in err
        err = refused(capsys, main(command(address, files, "cancel", job_id, operator="wrong")))
        assert "wrong operator token" in err
        assert [s.job_id for s in svc.queue.waiting] == [job_id]  # still queued

        err = refused(capsys, main(command(address, files, "admit", "bad")))
        assert "Admit is an operator call" in err
        assert svc.job.integrity.ledger.excluded("bad") is not None

        assert main(command(address, files, "cancel", job_id, operator="operator")) == 0
        assert not svc.queue.waiting
        assert main(command(address, files, "admit", "bad", operator="operator")) == 0
        assert svc.job.integrity.ledger.excluded("bad") is None
        # the read-only calls stay on the join token
        assert main(command(address, files, "jobs", "--json")) == 0
        assert job_id in capsys.readouterr().out


def test_a_bare_grpc_client_with_the_join_token_is_refused_before_anything_runs(
        tmp_path: Path) -> None:
    # what a hostile volunteer's own client sends: the join token, and an operator
    # token's header holding a guess or nothing
    async def main_() -> None:
        config = tiny_config(tmp_path, operator_token=OPERATOR)
        async with served(config) as (address, svc), \
                rpc.open_channel(address, SECURITY) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            svc.job.integrity.ledger.record("bad", "grad_mismatch", 42, "x", confirmed=True)
            calls: list[Any] = [
                stub.SubmitJob(coordinator_pb2.SubmitJobRequest(args=list(JOB))),
                stub.CancelJob(coordinator_pb2.CancelJobRequest(job_id="job-1")),
                stub.Admit(coordinator_pb2.AdmitRequest(agent_id="bad")),
                stub.Admit(coordinator_pb2.AdmitRequest(agent_id="bad"),
                           metadata=(("dtfm-operator-token", OPERATOR[:-1] + "1"),)),
            ]
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call
                assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert not svc.queue.waiting
            assert svc.job.integrity.ledger.excluded("bad") is not None
            await stub.GetStatus(coordinator_pb2.StatusRequest())  # reads stay open

    asyncio.run(main_())


def test_without_an_operator_token_the_join_token_suffices_and_start_says_so(
        tmp_path: Path, files: dict[str, str], capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    with serving(config()) as (address, svc):
        assert main(command(address, files, "submit", *JOB)) == 0
        job_id = svc.queue.waiting[0].job_id
        assert main(command(address, files, "cancel", job_id)) == 0
        assert main(command(address, files, "admit", "bad")) == 0
        assert not svc.queue.waiting and svc.job.integrity.ledger.excluded("bad") is None
        with caplog.at_level(logging.INFO, "coordinator.daemon.operator"):
            svc.operator.announce()  # what `serve` says once at start
    [warning] = [r for r in caplog.records if r.name == "coordinator.daemon.operator"]
    assert warning.levelno == logging.WARNING
    assert "any agent holding the join token" in warning.getMessage()
    assert "--operator-token-file" in warning.getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, "coordinator.daemon.operator"):
        OperatorGate(OPERATOR).announce()
    assert [r.levelno for r in caplog.records] == [logging.INFO]


@pytest.mark.parametrize(("token", "named"), [
    ("short", "is 5 bytes"), (SECURITY.token, "is the join token"),
    ("tab\tinside-the-operator-token", "printable ASCII")])
def test_a_weak_operator_token_is_refused_at_start(tmp_path: Path, token: str,
                                                   named: str) -> None:
    with pytest.raises(rpc.ConfigError, match=named) as info:
        tiny_config(tmp_path, operator_token=token).validate()
    assert "--operator-token-file" in str(info.value)
    assert token not in str(info.value) or token == "short"


def test_start_reads_the_flag_and_the_environment(tmp_path: Path, files: dict[str, str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from coordinator.daemon.operator import load_operator_token

    assert load_operator_token(files["operator"]) == OPERATOR
    assert load_operator_token(None) == ""
    monkeypatch.setenv(OPERATOR_ENV, OPERATOR)
    assert load_operator_token(None) == OPERATOR
