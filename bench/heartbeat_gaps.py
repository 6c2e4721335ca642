"""Benchmark: how late heartbeats reach the coordinator while the machine is busy, the figure
the default `--liveness-timeout` (coordinator/daemon/config.py) is chosen from.

Runs the loopback `coordinator demo` (a coordinator, 4 agents, a job of 80 steps) with
`--busy N` busy-loop processes beside it (`python -c 'while True: pass'`) and `--load`
(a shell command looped, say a `pip install`'s byte-compiling and writing), polls the
coordinator's status every 50 ms and records every agent's `last_seen` (the coordinator's
clock when a heartbeat arrived). The gaps between consecutive distinct values are the delays
between heartbeats as the coordinator received them (the agents send one a second). Prints
the count, median, p99 and largest gap and the agents ever seen `lost`, as one JSON line.
Run: `python bench/heartbeat_gaps.py --busy 1`.

"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python bench/heartbeat_gaps.py`
    sys.path.insert(0, str(REPO))

from dtfm import rpc  # noqa: E402
from protos.dtfm.v1 import coordinator_pb2, coordinator_pb2_grpc  # noqa: E402


async def _poll(address: str, token: str, going: Callable[[], bool]) -> dict[str, object]:
    seen: dict[str, list[float]] = {}
    lost: set[str] = set()
    async with rpc.open_channel(address, rpc.Security(token=token)) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        while going():
            try:
                status = await stub.GetStatus(coordinator_pb2.StatusRequest(), timeout=5.0)
            except Exception:  # noqa: BLE001 - starting or gone: poll again
                await asyncio.sleep(0.05)
                continue
            for a in status.agents:
                times = seen.setdefault(a.info.agent_id, [])
                if not times or a.last_seen_unix_s != times[-1]:
                    times.append(a.last_seen_unix_s)
                if a.state == coordinator_pb2.AGENT_STATE_LOST:
                    lost.add(a.info.agent_id)
            await asyncio.sleep(0.05)
    gaps = sorted(b - a for times in seen.values() for a, b in zip(times, times[1:], strict=False))
    return {"agents": len(seen), "gaps": len(gaps),
            "median_s": round(statistics.median(gaps), 3) if gaps else None,
            "p99_s": round(gaps[int(0.99 * (len(gaps) - 1))], 3) if gaps else None,
            "max_s": round(gaps[-1], 3) if gaps else None, "lost": sorted(lost)}


def _wan(args: argparse.Namespace) -> int:
    from coordinator.scheduler.scenarios import world_links
    from dtfm.wan.cluster import WanCluster, measurement_wan

    delay, bandwidth, _ = world_links(1, 25.0)
    workdir = Path(tempfile.mkdtemp(prefix="dtfm-hb-wan-"))
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.busy)]
    try:
        with measurement_wan(delay, bandwidth, coordinator_link=(args.wan, 25.0)) as wan:
            cluster = WanCluster(wan, workdir, agents=len(delay))
            cluster.start(prewarm=False)
            poller = wan.popen(0, [sys.executable, __file__, "--poll",
                                   cluster.coordinator_address, "150"],
                               env={**cluster.env(), "PYTHONPATH": str(REPO)},
                               stdout=subprocess.PIPE)
            started = time.monotonic()
            while time.monotonic() - started < 140:  # the links' probes load the hosts
                cluster.measure()
            out, _ = poller.communicate(timeout=60)
            cluster.stop()
        print(json.dumps({"busy": args.busy, "coordinator_one_way_ms": args.wan,
                          **json.loads(out)}))
        return 0
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--busy", type=int, default=1, help="busy-loop processes beside the demo")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--load", default="", help="a shell command run in a loop beside the demo "
                   "(e.g. what `pip install` does: byte-compile a large tree, write, fsync)")
    p.add_argument("--wan", type=float, default=0.0, metavar="MS",
                   help="instead of the demo: 8 agents in the paper's 8 cities, emulated, the "
                   "coordinator MS ms one way from each, measuring their links (needs root)")
    p.add_argument("--poll", nargs=2, metavar=("ADDRESS", "SECONDS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.poll:  # inside the coordinator's namespace (--wan): the token is in DTFM_TOKEN
        end = time.monotonic() + float(args.poll[1])
        print(json.dumps(asyncio.run(_poll(args.poll[0], os.environ["DTFM_TOKEN"],
                                           lambda: time.monotonic() < end))))
        return 0
    if args.wan:
        return _wan(args)
    workdir = Path(tempfile.mkdtemp(prefix="dtfm-hb-"))
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.busy)]
    if args.load:
        busy.append(subprocess.Popen(["bash", "-c", f"while true; do {args.load}; done"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True))
    demo = subprocess.Popen([sys.executable, "-m", "coordinator", "demo", "--workdir",
                             str(workdir), "--steps", str(args.steps)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert demo.stderr is not None
        line = demo.stderr.readline().decode()
        found = re.search(r"coordinator on (\S+),", line)
        if not found:
            print(f"the demo did not say its address: {line!r}", file=sys.stderr)
            return 1
        started = time.monotonic()
        result = asyncio.run(_poll(found.group(1), (workdir / "token").read_text(),
                                   lambda: demo.poll() is None))
        print(json.dumps({"busy": args.busy, "seconds": round(time.monotonic() - started),
                          "demo_exit": demo.returncode, **result}))
        return 0
    finally:
        for proc in (demo, *busy):
            with contextlib.suppress(ProcessLookupError):  # the load loop's whole group
                os.killpg(proc.pid, signal.SIGKILL) if proc.args[0] == "bash" else proc.kill()
            proc.wait()


if __name__ == "__main__":
    sys.exit(main())
