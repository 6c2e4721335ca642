"""A job on loopback with one agent made bad from outside the product, for the system tests
of the integrity checks (tests/agent/worker/badpeer_hook.py, loaded through
badpeer_site/sitecustomize.py on the bad agent's PYTHONPATH, whatever rank it gets)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dtfm.rpc import free_port
from tests.daemons import Daemons, wait_for

REPO = Path(__file__).resolve().parents[2]
SITE = REPO / "tests" / "agent" / "worker" / "badpeer_site"


def run_with_bad_peer(daemons: Daemons, honest: int, attack: str, from_step: int, steps: int,
                      *layout: str, bad_at: int = -1
                      ) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Train `steps` steps of gpt-tiny (`layout`: its --stages, --replicas, --batch) on
    `honest` honest agents and one whose workers `attack` every step from their
    `from_step`th optimizer step on, checked at `--verify full`, with a checkpoint every 4
    steps and room to shrink; the bad agent's id, the finished job's status and the agents'
    rows by id. `bad_at` >= 0: the agents listen on ascending ports and the bad one is that
    many into address order (with `--placement rank-order`, rank `bad_at`)."""
    _, address = daemons.coordinator(
        "--model", "gpt-tiny", "--agents", str(honest + 1), "--min-agents", "2", *layout,
        "--steps", str(steps), "--micro-batches", "1", "--checkpoint-every", "4",
        "--search-seconds", "1", "--no-measure", "--dp-mode", "sharded", "--verify", "full")
    bad_env = daemons.env(DTFM_TEST_BAD_PEER="*:" + ",".join(
        f"{s}={attack}" for s in range(from_step, steps + 1)),
        PYTHONPATH=os.pathsep.join([str(SITE), str(REPO)]))
    if bad_at < 0:
        for i in range(honest):
            daemons.agent(address, f"agent-{i}")
        daemons.agent(address, "bad", env=bad_env)
    else:
        ports = sorted(free_port() for _ in range(honest + 1))
        names = [f"agent-{i}" for i in range(honest)]
        names.insert(bad_at, "bad")
        for name, port in zip(names, ports, strict=True):
            daemons.agent(address, name, "--listen", f"127.0.0.1:{port}",
                          env=bad_env if name == "bad" else None)
    bad = wait_for(lambda: (p := daemons.tmp / "bad" / "agent-id").exists()
                   and p.read_text().strip(), 60, "the bad agent's id")
    wait_for(lambda: daemons.status(address)["job"]["state"] in ("done", "failed"), 240,
             "the job to finish", interval=0.5)
    status = daemons.status(address)
    return bad, status, {a["id"]: a for a in status["agents"]}
