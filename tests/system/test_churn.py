"""Churn with real processes on loopback and no shared storage: each agent keeps its own
checkpoints. An agent dies and the job shrinks onto the survivors, then grows back when a new
agent joins; the coordinator dies and a new one adopts the running job."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.daemons import Daemons, free_port, wait_for

pytestmark = pytest.mark.timeout(600)


def _job(daemons: Daemons, address: str) -> dict[str, Any]:
    return daemons.status(address)["job"]


@pytest.mark.parametrize(("sync_every", "every"), [(1, 5), (4, 4)], ids=["sync", "H4"])
def test_a_lost_agent_shrinks_the_job_and_a_new_one_grows_it_back(daemons: Daemons,
                                                                  sync_every: int,
                                                                  every: int) -> None:
    """With local steps (H = 4) checkpoints are taken at sync points and hold the outer
    optimizer: the survivors resume a round from one, and the newcomer fetches it."""
    _, address = daemons.coordinator(
        "--model", "gpt-tiny", "--agents", "6", "--min-agents", "4", "--stages", "2",
        "--replicas", "3", "--steps", "90", "--batch", "12", "--micro-batches", "2",
        "--checkpoint-every", str(every), "--search-seconds", "1", "--no-measure",
        "--sync-every", str(sync_every))
    # each agent's spare worker forks every epoch's worker: one import of torch per agent
    agents = {f"agent-{i}": daemons.agent(address, f"agent-{i}") for i in range(6)}
    wait_for(lambda: _job(daemons, address)["step"] >= 8, 300, "training to pass step 8",
             interval=0.2)
    status = daemons.status(address)
    assert (status["job"]["stages"], status["job"]["replicas"]) == (2, 3)
    ids = {(daemons.tmp / name / "agent-id").read_text().strip(): name for name in agents}
    victim = ids[status["plan"]["grid"][1][2]]
    os.killpg(agents[victim].pid, signal.SIGKILL)

    shrunk = wait_for(lambda: (j := _job(daemons, address))["epoch"] == 2 and j["step"] > 0
                      and j["recoveries"] and j["recoveries"][-1]["stalled_s"] > 0 and j,
                      180, "the job to continue on 2x2", interval=0.5)
    assert (shrunk["stages"], shrunk["replicas"]) == (2, 2), shrunk
    first = shrunk["recoveries"][0]
    assert first["layout_before"] == "2x3" and first["layout_after"] == "2x2", shrunk
    # resumed from a checkpoint the survivors hold, not from step 0
    assert first["resumed_step"] >= every and first["steps_lost"] <= every + 3, first
    assert first["resumed_step"] % sync_every == 0, first  # a sync point

    # a newcomer: it holds no checkpoint at all
    daemons.agent(address, "agent-6")
    grown = wait_for(lambda: (j := _job(daemons, address))["epoch"] == 3 and j["step"] > 0
                     and j["recoveries"][-1]["stalled_s"] > 0 and j,
                     240, "the job to grow back to 2x3", interval=0.5)
    assert (grown["stages"], grown["replicas"]) == (2, 3), grown
    back = grown["recoveries"][-1]
    assert back["planned"] and back["layout_after"] == "2x3"
    assert back["resumed_step"] >= first["resumed_step"] + every, back  # a newer checkpoint
    assert back["resumed_step"] % sync_every == 0, back
    done = wait_for(lambda: (j := _job(daemons, address))["state"] in ("done", "failed") and j,
                    300, "the job to finish", interval=0.5)
    assert done["state"] == "done" and done["step"] == 90, done


def test_a_restarted_coordinator_adopts_the_job_and_it_completes(daemons: Daemons,
                                                                  tmp_path: Path) -> None:
    port = free_port()
    flags = ("--model", "gpt-tiny", "--agents", "2", "--stages", "2", "--replicas", "1",
             "--steps", "60", "--batch", "4", "--micro-batches", "2", "--checkpoint-every",
             "5", "--search-seconds", "1", "--no-measure", "--state-dir",
             str(tmp_path / "coordinator"))
    coordinator, address = daemons.coordinator(*flags, port=port)
    for i in range(2):
        daemons.agent(address, f"agent-{i}")
    wait_for(lambda: _job(daemons, address)["step"] >= 7, 240, "training to pass step 7",
             interval=0.2)
    before = _job(daemons, address)
    os.killpg(coordinator.pid, signal.SIGKILL)
    coordinator.wait(10)

    _, again = daemons.coordinator(*flags, port=port)
    assert again == address
    done = wait_for(lambda: (j := _job(daemons, address))["state"] in ("done", "failed") and j,
                    300, "the adopted job to finish", interval=0.5)
    assert done["state"] == "done" and done["step"] == 60, done
    assert done["id"] == before["id"]  # the same job, so the same checkpoints
    assert done["epoch"] == 1 and not done["recoveries"], done  # adopted, not restarted


def test_too_few_agents_for_every_stage_finish_the_job_on_fewer_stages(
        daemons: Daemons) -> None:
    """2 stages x 1 replica with --min-agents 1: the agent of stage 1 is SIGKILLed and the job
    continues on one stage, its layers read from both stages' checkpoints (stage 1's from the
    copy the survivor mirrored), and finishes its steps."""
    _, address = daemons.coordinator(
        "--model", "gpt-tiny", "--agents", "2", "--min-agents", "1", "--stages", "2",
        "--replicas", "1", "--steps", "60", "--batch", "4", "--micro-batches", "2",
        "--checkpoint-every", "5", "--search-seconds", "1", "--no-measure")
    agents = {f"agent-{i}": daemons.agent(address, f"agent-{i}") for i in range(2)}
    # past a few checkpoints, and long enough for a mirror poll (every second) to copy one
    wait_for(lambda: _job(daemons, address)["step"] >= 12, 300, "training to pass step 12",
             interval=0.2)
    status = daemons.status(address)
    assert (status["job"]["stages"], status["job"]["replicas"]) == (2, 1)
    ids = {(daemons.tmp / name / "agent-id").read_text().strip(): name for name in agents}
    wait_for(lambda: any(p.name.endswith(".manifest.json") for p in (
        daemons.tmp / ids[status["plan"]["grid"][0][0]]).rglob("stage-1/*")), 60,
        "stage 0's agent to mirror a checkpoint of stage 1")
    os.killpg(agents[ids[status["plan"]["grid"][1][0]]].pid, signal.SIGKILL)

    done = wait_for(lambda: (j := _job(daemons, address))["state"] in ("done", "failed") and j,
                    300, "the job to finish on one stage", interval=0.5)
    assert done["state"] == "done" and done["step"] == 60, done
    assert (done["stages"], done["replicas"]) == (1, 1), done
    first = done["recoveries"][0]
    assert first["layout_before"] == "2x1" and first["layout_after"] == "1x1", first
    assert first["resumed_step"] >= 5, first  # from checkpoints, not from step 0
    plan = daemons.status(address)["plan"]
    assert plan["layer_splits"] == [4], plan
