"""Two agents of one site, behind one NAT, talk directly (issue 32): a 3-stage pipeline
across emulated hosts whose two NAT'd stages are neighbours sends nothing through the relay,
and trains to the losses of the same job with every host reachable (same seed, gloo).

Agent 0 is public; agents 1 and 2 share a NAT (one LAN: each dials the other at its private
address, nobody else reaches either). The dial-back finds each reachable from some peers
only (the other one got through); the coordinator's data plane lets each dial the other
directly (`DataPlane.direct`), and they dial agent 0. No pair lacks a direct path, so the
coordinator's relay, which still runs, forwards nothing. Before, a some-peers agent was taken
as reachable from nowhere and the pair between the two stages met at the relay: the relay's
counter (`coordinator status --json`, job.relay) is what this pins.

`--placement rank-order` (agents in address order, the NAT'd private 192.168.1.x after the
public one) makes the two NAT'd agents stages 1 and 2, neighbours; `--no-measure`, as rank
order needs no links: the dial-back's evidence alone lets them dial each other.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from dtfm.wan import WanEmulator
from dtfm.wan.cluster import WanCluster, measurement_wan
from tests.progress import step_losses

AVAILABLE, WHY = WanEmulator.available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"no WAN emulator here: {WHY}")

AGENTS, SITE = 3, [1, 2]
DELAY = [[0, 10, 10], [10, 0, 1], [10, 1, 0]]
RATE = [[0, 100, 100], [100, 0, 1000], [100, 1000, 0]]
STEPS = 6
JOB = ["--model", "gpt-tiny", "--agents", str(AGENTS), "--stages", "3", "--replicas", "1",
       "--steps", str(STEPS), "--batch", "8", "--micro-batches", "2", "--seed", "11",
       "--search-seconds", "1", "--no-measure", "--eval-batches", "0",
       "--heartbeat-interval", "0.5", "--layer-split", "even", "--placement", "rank-order"]


def _run(tmp: Path, shared_nat: list[list[int]], transport: str
         ) -> tuple[list[str], dict[str, Any], dict[tuple[int, int], float]]:
    with measurement_wan(DELAY, RATE, shared_nat=shared_nat) as wan:
        cluster = WanCluster(wan, tmp, agents=AGENTS,
                             coordinator_args=[*JOB, "--transport", transport])
        ids, status = cluster.run_to_end(300)
    job = status["job"]
    assert job["state"] == "done" and job["step"] == STEPS, job
    losses = {(step, rank): loss for rank, steps in step_losses(tmp, job["id"]).items()
              for step, loss in steps.items()}
    return ids, status, losses


@pytest.mark.timeout(600)
def test_two_agents_behind_one_nat_talk_directly_and_train_to_glooss_losses(
        tmp_path: Path) -> None:
    _, _, ref = _run(tmp_path / "reachable", [], "gloo")
    ids, status, got = _run(tmp_path / "site", [SITE], "dtfm")
    job = status["job"]
    verdicts = {a["id"]: a["reach"]["verdict"] for a in status["agents"]}
    assert verdicts[ids[1]] == verdicts[ids[2]] == "some-peers", verdicts
    assert verdicts[ids[0]] == "everywhere", verdicts
    grid = status["plan"]["grid"]
    assert [row[0] for row in grid] == ids, (grid, ids)  # the NAT'd pair: stages 1 and 2
    # the pair's activations and gradients went direct: no circuit of theirs at the relay
    log = (tmp_path / "site" / "coordinator.log").read_text(errors="replace")
    direct = re.search(r"pairs dial a member reachable from some peers only directly "
                       r"\(1->2, 2->1\); (\d+) pairs meet at a relay", log)
    assert "dtfm data plane" in log and direct, log[-3000:]
    assert not re.search(r"relay: circuit between ranks (1 and 2|2 and 1)", log), log[-3000:]
    # pairs with agent 0 meet at the relay only if its own verdict had not come in when the
    # epoch was planned; those punch through (test_wan_punch.py), so the relay carried
    # at most their one-byte "got through" frames
    assert job["relay"]["forwarded_bytes"] <= 2 * int(direct.group(1)), job
    assert sorted(got) == sorted(ref) and len(ref) >= STEPS, (sorted(got), sorted(ref))
    assert got == ref  # bit for bit: same seed, same data, same weights
