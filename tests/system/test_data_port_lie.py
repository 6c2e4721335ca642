"""A member that advertises another agent's data port is found out, and the job trains
(issue 41), with real processes on loopback.

Agent `honest` accepts no connections by its verdict (`--reachable no`: a NAT) but serves its
gRPC port P, data plane and all, as every agent does; agent `liar` advertises data port P
(tests/system/lying_agent.py patches the advertised port: a seam, no product flag) while it
really listens elsewhere. Its own gRPC port answers the dial-back, so it is found reachable,
and its peer-table entry would be P: honest's worker dialled the liar's rank at its own port,
the handshake answered as the wrong rank ("the peer table is stale"), every epoch failed as
"worker on honest failed", and the job failed with the liar never named.

- liar joins after honest listens: the coordinator's dial of the liar's data port at join is
  answered by honest's id, so the port is refused at join, named in the liar's reachability
  line and the coordinator's log; both members only dial out and meet at the relay;
- liar joins before honest listens (nothing answers at P then): the first epoch fails on the
  stale entry, the failure is blamed on the liar (whose entry was wrong), its port is refused,
  and the next epoch trains.
"""

from __future__ import annotations

from typing import Any

import pytest

from dtfm.rpc import listening
from tests.daemons import Daemons, free_port, wait_for

pytestmark = pytest.mark.timeout(300)

JOB = ["--model", "gpt-tiny", "--agents", "2", "--stages", "2", "--replicas", "1",
       "--steps", "3", "--batch", "4", "--micro-batches", "2", "--seed", "3",
       "--search-seconds", "1", "--no-measure", "--eval-batches", "0", "--layer-split", "even"]


def _liar(daemons: Daemons, address: str, lie: int, port: int = 0) -> None:
    daemons.spawn(["tests.system.lying_agent", str(lie), "start", "--coordinator", address,
                   "--state-dir", str(daemons.tmp / "liar"), "--device", "cpu",
                   "--listen", f"127.0.0.1:{port or free_port()}"], "liar")


def _honest(daemons: Daemons, address: str, port: int, *extra: str) -> None:
    daemons.agent(address, "honest", "--listen", f"127.0.0.1:{port}", *extra)


def _done(daemons: Daemons, address: str) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        job = daemons.status(address)["job"]
        assert job["state"] != "failed", job
        return job if job["state"] == "done" else None

    job: dict[str, Any] = wait_for(done, 240, "the job to finish", interval=0.5)
    return job


def _id(daemons: Daemons, name: str) -> str:
    return (daemons.tmp / name / "agent-id").read_text().strip()


def test_a_data_port_another_agent_answers_at_is_refused_at_join(daemons: Daemons) -> None:
    coordinator, address = daemons.coordinator(*JOB)
    port = free_port()
    _honest(daemons, address, port, "--reachable", "no")
    wait_for(lambda: listening(f"127.0.0.1:{port}"), 30, "honest to listen")
    _liar(daemons, address, port)
    job = _done(daemons, address)
    liar, honest = _id(daemons, "liar"), _id(daemons, "honest")
    rows = {a["id"]: a for a in daemons.status(address)["agents"]}
    summary = rows[liar]["reach"]["summary"]
    refusal = f"agent {liar}'s data port {port} is not used: 127.0.0.1:{port} is agent {honest}'s"
    assert refusal in summary, rows
    log = daemons.log(coordinator)
    assert refusal in log, log[-3000:]
    assert f"{liar} (data port refused)" in log, log[-3000:]
    assert not job.get("recoveries"), job  # trained in its first epoch, nobody blamed


def test_a_stale_entry_is_blamed_on_the_agent_whose_entry_was_wrong(daemons: Daemons) -> None:
    """Both reachable, on the dtfm data plane, the liar first in address order (rank 0), so
    honest (rank 1) dials the liar's entry, its own port, and its own worker answers."""
    coordinator, address = daemons.coordinator(*JOB, "--transport", "dtfm",
                                                "--placement", "rank-order")
    low, high = sorted((free_port(), free_port()))
    _liar(daemons, address, high, port=low)  # nothing answers at the false port yet
    wait_for(lambda: (daemons.tmp / "liar" / "agent-id").exists()
             and any(a["reach"]["verdict"] != "unknown"
                     for a in daemons.status(address)["agents"]), 60, "the liar's verdict")
    _honest(daemons, address, high)
    job = _done(daemons, address)
    liar, honest = _id(daemons, "liar"), _id(daemons, "honest")
    reasons = [r["reason"] for r in job.get("recoveries", [])]
    assert len(reasons) == 1, job
    assert reasons[0].startswith(
        f"rank 0's peer-table entry 127.0.0.1:{high} was answered by rank 1: agent {liar}'s "
        f"data port {high} is not used: 127.0.0.1:{high} is agent {honest}'s"), reasons
    assert f"seen by the worker on {honest}" in reasons[0], reasons
    log = daemons.log(coordinator)
    assert f"{liar} (data port refused)" in log, log[-3000:]
