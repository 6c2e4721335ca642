"""A job with agents that accept no connections trains over the dtfm transport (issue 32),
with real processes on loopback: three of four agents start `--reachable no`, so the
coordinator picks the "dtfm" backend; they dial out to the listening one and, between
themselves, meet at the coordinator's relay (in a 2 x 2 job any three ranks hold a pair that
talks: a pipeline or a data-parallel pair). The same job with every agent reachable runs on
gloo, and both give the same losses, step for step, bit for bit (same seed; dtfm's
two-member all_reduce and its point-to-point messages are exactly gloo's). Every dtfm
connection crosses the daemons' one port each (the coordinator's gRPC port for the relay,
the listening agent's gRPC port for its worker)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.daemons import Daemons, wait_for
from tests.progress import step_losses

pytestmark = pytest.mark.timeout(600)

STEPS = 6
JOB = ["--model", "gpt-tiny", "--agents", "4", "--stages", "2", "--replicas", "2",
       "--steps", str(STEPS), "--batch", "8", "--micro-batches", "2", "--seed", "3",
       "--search-seconds", "1", "--no-measure", "--eval-batches", "0",
       "--layer-split", "even"]


def train_job(daemons: Daemons, tag: str, agent_args: list[list[str]], *coordinator_args: str
              ) -> tuple[dict[str, Any], list, str, str, str]:
    """Run JOB on agents started with `agent_args` (one list per agent) until it is done;
    (the job's status, the agents, the coordinator's log, every status message seen, the
    coordinator's address)."""
    coordinator, address = daemons.coordinator(*JOB, *coordinator_args)
    agents = [daemons.agent(address, f"{tag}-{i}", *args) for i, args in enumerate(agent_args)]
    seen: list[str] = []

    def done() -> dict[str, Any] | None:
        job = daemons.status(address)["job"]
        seen.append(job["message"])
        assert job["state"] != "failed", job
        return job if job["state"] == "done" else None

    job = wait_for(done, 400, f"the {tag} job to finish", interval=0.5)
    return job, agents, daemons.log(coordinator), " | ".join(dict.fromkeys(seen)), address


def test_unreachable_agents_train_over_dtfm_to_gloos_losses(daemons: Daemons) -> None:
    gloo, *_ = train_job(daemons, "open", [[]] * 4)
    relayed, _, log, messages, _ = train_job(daemons, "nat", [["--reachable", "no"]] * 3 + [[]])
    # the job took the unreachable agents in and said they are relayed
    assert "relayed through the coordinator's relay" in messages, messages
    assert "dtfm data plane, 3 of 4 members dial out only" in log, log[-3000:]
    assert "relay: circuit between ranks" in log, log[-3000:]
    worker_logs = {p: p.read_text(errors="replace")
                   for p in daemons.tmp.glob("*/work/*.log")}
    open_logs = [t for p, t in worker_logs.items() if p.parts[-3].startswith("open-")]
    nat_logs = [t for p, t in worker_logs.items() if p.parts[-3].startswith("nat-")]
    assert any("via gloo" in t or "gloo via" in t for t in open_logs), open_logs[:1]
    assert sum("dtfm via the assignment's peer table" in t for t in nat_logs) == 4, nat_logs
    # one port per daemon (dtfm/net/front.py): the relay shares the coordinator's gRPC port, and
    # the listening agent's worker takes its peers' connections from the agent's gRPC port
    assert "data-plane relay on the gRPC port" in log, log[-3000:]
    assert sum("data plane served on the agent's port" in t for t in nat_logs) == 1, nat_logs
    ref = step_losses(daemons.tmp, gloo["id"], 1)
    got = step_losses(daemons.tmp, relayed["id"], 1)
    assert sorted(ref) == sorted(got) == [0, 1, 2, 3]
    assert all(sorted(steps) == list(range(1, STEPS + 1)) for steps in got.values())
    assert got == ref  # bit for bit: the same floats from the same seed
