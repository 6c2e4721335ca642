"""`World.dp_gather` carries each replica's row from that replica only (issue 43).

Three real gloo processes on loopback, one data-parallel group. Ranks 0 and 1 are honest and
gather through `World.dp_gather`; rank 2 is a bad replica with its own code: it sends a
different row to each peer. The weights digest and the averaged-shard audit are judged on
these rows, so what must hold is that an honest replica's row arrives at every peer as it
was sent, whatever a bad one does: the bad one can lie about its own row only (and every
peer can see it lied differently to each). With a sum of one-hot rows (an all-reduce), any
participant could add to any slot as it forwards partial sums.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dtfm.rpc import free_port

REPO = Path(__file__).resolve().parents[3]

RANK = textwrap.dedent("""
    import json, sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    from agent.worker.deadline import Deadline, Policy
    from agent.worker.world import TAG_DP_GATHER, World

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=3, timeout=timedelta(seconds=60))
    group = dist.new_group([0, 1, 2], timeout=timedelta(seconds=60))
    if rank == 2:  # the bad replica: a different row to each peer, then out
        works = [dist.isend(torch.tensor([666.0 + dst, 2.0 ** 52 + 1], dtype=torch.float64),
                            dst=dst, group=group, tag=TAG_DP_GATHER) for dst in (0, 1)]
        bufs = [torch.empty(2, dtype=torch.float64) for _ in (0, 1)]
        works += [dist.irecv(b, src=src, group=group, tag=TAG_DP_GATHER)
                  for b, src in zip(bufs, (0, 1))]
        for w in works:
            w.wait()
        print(json.dumps([b.tolist() for b in bufs]), flush=True)
    else:
        dl = Deadline(Policy(ceiling_s=60.0, floor_s=30.0, warm_steps=1))
        dl.start()
        world = World(links=None, pipe_group=None, dp_group=group, pipeline=[rank], rank=rank,
                      device=torch.device("cpu"), deadline=dl)
        print(json.dumps(world.dp_gather([rank * 10.0 + 1, 2.0 ** 52 + rank])), flush=True)
    dist.barrier(group)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups on loopback")
@pytest.mark.timeout(120)
def test_each_row_comes_from_its_own_replica_and_a_liar_can_lie_only_about_its_own() -> None:
    import json

    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), port], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, start_new_session=True) for r in (0, 1, 2)]
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    seen = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    honest = [[1.0, 2.0 ** 52], [11.0, 2.0 ** 52 + 1]]
    assert seen[0] == [honest[0], honest[1], [666.0, 2.0 ** 52 + 1]]
    assert seen[1] == [honest[0], honest[1], [667.0, 2.0 ** 52 + 1]]
    assert seen[2] == honest  # what the bad replica received: the honest rows, exact
