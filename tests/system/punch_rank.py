"""One rank of test_wan_punch.py: a dtfm mesh in an emulated host that listens nowhere, so
every peer is reached through the relay, with hole punching on. Sends its rank to every
peer, receives every peer's, and writes what it got and which peers it punched to as JSON.

Run inside a host: `python -m tests.system.punch_rank RANK WORLD RELAY SECRET_FILE OUT`."""

from __future__ import annotations

import json
import logging
import sys
from datetime import timedelta

import torch

from agent.worker.transport.config import TransportConfig
from agent.worker.transport.mesh import Mesh

TIMEOUT = timedelta(seconds=60)


def main(rank: int, world: int, relay: str, secret_file: str, out: str) -> None:
    logging.basicConfig(level=logging.INFO, format=f"rank{rank} %(name)s %(message)s")
    with open(secret_file, "rb") as f:
        secret = f.read().strip()
    cfg = TransportConfig("punch-job", 1, secret, dict.fromkeys(range(world)), relay=relay,
                          timeout=TIMEOUT, hole_punch=True)
    mesh = Mesh(cfg, rank)
    peers = [r for r in range(world) if r != rank]
    got = {r: torch.zeros(1000) for r in peers}
    works = [mesh.recv(r, 7, 1, got[r]) for r in peers]
    works += [mesh.send(r, 7, 1, torch.full((1000,), float(rank))) for r in peers]
    for w in works:
        w.wait(TIMEOUT)
    received = {str(r): sorted(set(t.tolist())) for r, t in got.items()}
    punched = mesh.stats()["punched"]
    mesh.close()
    with open(out, "w") as f:
        json.dump({"received": received, "punched": punched}, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
