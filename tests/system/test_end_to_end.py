"""The whole product on loopback: agents join, measure, get a plan, train, and recover."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.daemons import Daemons, wait_for
from tests.progress import job_losses, step_losses


@pytest.mark.timeout(600)
def test_demo_trains_a_gpt_and_the_loss_falls(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "coordinator", "demo", "--steps", "40", "--json",
         "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=560)
    assert out.returncode == 0, out.stderr[-3000:]
    updates = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    states = [u["state"] for u in updates]
    assert states[-1] == "done" and "running" in states, states
    # the demo prints what it sees once a second; the coordinator logs every transition
    # (scheduling 4 agents can take less than the second, and a poll then misses it)
    log = (tmp_path / "coordinator.log").read_text()
    for state in ("measuring", "scheduling", "running", "done"):
        assert f": {state} — " in log, f"the job never went through {state}: {states}"
    losses = [u["loss"] for u in updates if u["step"] > 0]
    assert losses[-1] < losses[0], losses
    # every step's loss, as the workers wrote it (the demo's once-a-second look may first
    # see a step well past the first)
    job_id = next(tmp_path.glob("agent-*/work/*.progress.jsonl")).name.rsplit("-e", 1)[0]
    by_step = job_losses(tmp_path, job_id)
    assert sorted(by_step) == list(range(1, 41)), sorted(by_step)
    assert by_step[1] > 5.0  # a byte-level model starts near ln(256) = 5.55
    assert by_step[40] < by_step[1] - 1.0, by_step
    # the last update sums it up: where the loss went, how long it took, what to try next
    summary = updates[-1]["summary"]
    assert summary["last_loss"] < summary["first_loss"]
    assert summary["first_step"] < summary["last_step"] <= 40 == summary["steps"]
    assert summary["seconds"] > 0 and summary["step_s"] > 0
    assert (f"loss {summary['first_loss']:.3f} at step {summary['first_step']} -> "
            f"{summary['last_loss']:.3f} at step {summary['last_step']}") in out.stderr
    assert "plan cost" in out.stderr
    assert "sudo .venv/bin/coordinator demo --wan world" in out.stderr
    assert '"Running a real cluster"' in out.stderr
    # the web view is on, and the demo says where (the URL logs the browser in once)
    assert "demo: watch it live in a browser: http://127.0.0.1:" in out.stderr
    assert "/login?token=" in out.stderr


def _job(daemons: Daemons, address: str) -> dict:
    return daemons.status(address)["job"]


@pytest.mark.timeout(600)
def test_job_recovers_from_a_lost_agent_and_resumes_from_checkpoints(daemons: Daemons) -> None:
    ckpt = daemons.tmp / "ckpt"
    _, address = daemons.coordinator(
        "--model", "gpt-tiny", "--agents", "2", "--stages", "2", "--replicas", "1",
        "--steps", "150", "--batch", "4", "--micro-batches", "2", "--checkpoint-dir", str(ckpt),
        "--checkpoint-every", "5", "--search-seconds", "1", "--max-restarts", "2")
    agents = {f"agent-{i}": daemons.agent(address, f"agent-{i}") for i in range(3)}
    wait_for(lambda: _job(daemons, address)["step"] >= 7, 240, "training to pass step 7",
             interval=0.1)
    status = daemons.status(address)
    assert status["job"]["epoch"] == 1
    members = {a for row in status["plan"]["grid"] for a in row}
    assert len(members) == 2
    ids = {(daemons.tmp / name / "agent-id").read_text().strip(): name for name in agents}
    victim_name = ids[sorted(members)[0]]
    os.killpg(agents[victim_name].pid, signal.SIGKILL)

    done = wait_for(lambda: (j := _job(daemons, address))["state"] in ("done", "failed") and j,
                    400, "the job to finish after recovery", interval=0.5)
    assert done["state"] == "done", done
    assert done["epoch"] == 2
    assert done["step"] == 150
    states = {a["id"]: a["state"] for a in daemons.status(address)["agents"]}
    assert states[sorted(members)[0]] == "lost"
    # The second epoch resumed from a recent checkpoint instead of starting over. The step
    # the victim reached is the last its own worker wrote: the coordinator's view of the step
    # lags by a heartbeat, which a fast worker fills with several steps (CI saw 14 reported
    # while the worker was past 20).
    # (with one replica per stage no rank steps past its dead pipeline neighbour, so the
    # newest step of epoch 1 is the victim's; the files are read with the product's parser,
    # which skips a line the kill cut in half)
    killed_at_step = max(max(steps) for steps in
                         step_losses(daemons.tmp, done["id"], epoch=1).values())
    first_steps = [min(steps) for steps in step_losses(daemons.tmp, done["id"], 2).values()]
    assert len(first_steps) == 2, first_steps
    # --checkpoint-every 5, and the newest one may still be being written when the agent died
    assert all(max(1, killed_at_step - 10) < s <= killed_at_step + 1 for s in first_steps), (
        first_steps, killed_at_step)
    time.sleep(0.5)
    # the dead agent's worker died with it (parent-death signal), leaving no orphan
    orphans = subprocess.run(["pgrep", "-f", f"{daemons.tmp}/{victim_name}/work"],
                             capture_output=True, text=True)
    assert orphans.stdout.strip() == "", "the lost agent's worker outlived it"
