"""A wait that passes its deadline returns control, and the process that raised can exit.

Two real gloo processes on loopback: rank 1 joins and then never answers (it sleeps, like a
frozen peer whose sockets stay open); rank 0 waits through `errors.wait_all` with a deadline
far below the process group's own 120 s timeout. c10d must give control back at the deadline
for point-to-point and collective work alike, the `PeerError` must say how long and why, and
rank 0 must then be able to end its process although gloo still holds the unfinished work.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dtfm.rpc import free_port

REPO = Path(__file__).resolve().parents[2]
LIMIT_S = 2.0

RANK = textwrap.dedent("""
    import sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from agent.worker.deadline import Deadline, Policy
    from agent.worker.errors import PeerError, exit_now, wait_all

    rank, port, kind = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=120))
    group = dist.new_group([0, 1], timeout=timedelta(seconds=120))
    if rank == 1:
        time.sleep(300)  # alive, sockets open, never answering
    clock = [0.0]
    dl = Deadline(Policy(ceiling_s=120.0, floor_s=%(limit)r, warm_steps=1),
                  clock=lambda: clock[0])
    dl.start()
    for dt in (5.0, 0.01):  # the first step is never counted; then a 0.01 s step
        clock[0] += dt
        dl.step_finished()
    buf = torch.zeros(4)
    if kind == "p2p":
        works = [dist.irecv(buf, src=1, group=group, tag=7)]
    else:
        works = [dist.all_reduce(buf, group=group, async_op=True)]
    t0 = time.monotonic()
    try:
        wait_all(works, dl, f"rank 0: {kind} with rank 1")
    except PeerError as e:
        print(f"after {time.monotonic() - t0:.2f} s: {e}", flush=True)
        exit_now(e, "rank 0 failed")
    print("no error", flush=True)
""") % {"limit": LIMIT_S}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups on loopback")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["p2p", "collective"])
def test_a_timed_out_wait_returns_and_the_process_exits(kind: str) -> None:
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), port, kind], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, start_new_session=True) for r in (0, 1)]
    try:
        t0 = time.monotonic()
        out, err = procs[0].communicate(timeout=90)
        exited_s = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert procs[0].returncode == 1, (out, err)
    assert "no answer within 2 s" in out, (out, err)
    assert "the floor" in out and "0.01 s" in out, out  # why that long
    waited = float(out.split("after ", 1)[1].split(" s:", 1)[0])
    assert LIMIT_S * 0.9 <= waited < LIMIT_S + 3.0, out
    # joining took part of exited_s; what matters is that exit did not wait for gloo's
    # own 120 s timeout of the unfinished work
    assert exited_s < 60, f"rank 0 took {exited_s:.1f} s to exit: {err[-2000:]}"
