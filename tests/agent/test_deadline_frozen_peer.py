"""A frozen peer is found in seconds once steps are measured, not after the 300 s ceiling.

A real local job (`agent local`, gloo on loopback, 2 stages x 2 replicas) trains until every
rank has measured its steps; then one worker is SIGSTOPped. Its sockets stay open, so no
connection error ever reaches its neighbours: only their waits' deadline can end the job.
The test asserts that a neighbour fails with a `peer` error that names the deadline and why
it was chosen, that the deadline is the adaptive one (a multiple of the measured step, at
least the floor) and far under the ceiling, and that the whole job is down within that
deadline plus a margin for exiting and tearing down (not against a wall-clock speed target).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agent.worker.deadline import Policy
from tests.agent.worker.testlib import worker_pids

REPO = Path(__file__).resolve().parents[2]
CEILING_S = 300.0
WARM = 8  # steps every rank reports before the freeze: well past Policy.warm_steps + 1
MARGIN_S = 25.0  # a neighbour's exit, the launcher's poll and teardown, on a busy 2-core box
FLAGS = ("--model", "gpt-tiny", "--stages", "2", "--replicas", "2", "--batch", "8",
         "--steps", "100000", "--eval-batches", "1", "--checkpoint-every", "0")


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return out


def _kill(pid: int) -> None:
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(240)
def test_a_sigstopped_worker_fails_its_neighbours_within_the_adaptive_deadline(
    tmp_path: Path,
) -> None:
    cmd = [sys.executable, "-m", "agent.commands.local", "--json", "--threads", "1", *FLAGS,
           "--timeout", str(CEILING_S), "--workdir", str(tmp_path)]
    launcher = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    pids: dict[int, int] = {}
    steps = [0] * 4
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and launcher.poll() is None:
            steps = [len([e for e in _events(tmp_path / f"rank{r}.progress.jsonl")
                          if e.get("event") == "step"]) for r in range(4)]
            if min(steps) >= WARM:
                break
            time.sleep(0.2)
        assert launcher.poll() is None, launcher.communicate()[1]
        assert min(steps) >= WARM, f"the job did not reach {WARM} steps: {steps}"
        pids = worker_pids(tmp_path, 4)
        assert sorted(pids) == [0, 1, 2, 3], pids
        frozen = 1  # stage 1, replica 0: rank 0 waits for its gradients, rank 3 in all-reduce
        t_stop = time.monotonic()
        os.kill(pids[frozen], signal.SIGSTOP)
        _, err = launcher.communicate(timeout=CEILING_S / 2)
        down_s = time.monotonic() - t_stop
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        for pid in (pids or worker_pids(tmp_path, 4)).values():
            _kill(pid)

    assert launcher.returncode != 0, err
    errors = [(r, e) for r in range(4) if r != frozen
              for e in _events(tmp_path / f"rank{r}.progress.jsonl") if e.get("event") == "error"]
    timed_out = [(r, e) for r, e in errors if "no answer within" in e["message"]]
    assert timed_out, f"no neighbour reported a timed-out wait: {errors}\n{err}"
    rank, event = timed_out[0]
    assert event["kind"] == "peer" and event["phase"] == "train", event
    msg = event["message"]
    # it names whom it waited for: a rank, or the group (whichever rank gave up first: the
    # frozen rank's neighbours, or a rank waiting on one of them)
    assert re.search(r"rank \d|\[\d+(, \d+)*\]", msg), msg

    # the deadline it quotes, and why: a multiple of the measured step, or the floor
    limit = float(re.search(r"no answer within ([0-9.e+]+) s", msg).group(1))
    policy = Policy()
    why = re.search(r"the slowest of the last \d+ steps \(([0-9.e+-]+) s\)", msg)
    assert why, f"the error does not say why its deadline was chosen: {msg}"
    slowest = float(why.group(1))
    expected = min(CEILING_S, max(policy.floor_s, policy.step_multiple * slowest))
    assert limit == pytest.approx(expected, rel=0.02, abs=0.05), msg
    # the step it measured is this rank's own recent steps (each interval covers one step;
    # the first step is never counted)
    recent = [e["step_s"] for e in _events(tmp_path / f"rank{rank}.progress.jsonl")
              if e.get("event") == "step"][1:][-policy.window:]
    assert slowest >= 0.5 * max(recent), (slowest, recent)
    print(f"rank {rank} gave up on the frozen rank {frozen} after {limit:g} s; the job was down "
          f"{down_s:.1f} s after the SIGSTOP: {msg}")
    assert limit < CEILING_S / 5, f"{limit} s is not well under the {CEILING_S:g} s ceiling"
    assert down_s < limit + MARGIN_S, (
        f"the job took {down_s:.1f} s to go down after the freeze; its deadline was "
        f"{limit:g} s ({msg})")
