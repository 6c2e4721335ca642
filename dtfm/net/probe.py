"""The receiving end of a link probe, shared by every program a peer may measure.

A peer measures its link to us by streaming `ProbeChunk`s into `Agent.Probe` and reading
back, per window of time, how many bytes arrived (agent/probing/linkprobe.py is the sending end).
Agents answer it for their peers, and the coordinator answers it too, as the relay: an agent
nobody can dial measures its link to the relay by dialling out to the coordinator
(coordinator/links/relayed.py). One implementation, so both ends of every probe agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from protos.dtfm.v1 import agent_pb2

DEFAULT_WINDOW_S = 0.25
MIN_WINDOW_S = 0.01
MAX_WINDOW_S = 10.0


async def windows(request_iterator: AsyncIterator[agent_pb2.ProbeChunk]
                  ) -> AsyncIterator[agent_pb2.ProbeWindow]:
    """Report arrivals per window of time, on a timer, until the caller half-closes.

    Windows run on a clock, not on arrivals, so a caller that paces itself by these
    reports (and so may pause) always hears back.
    """
    window_s = DEFAULT_WINDOW_S
    totals = {"bytes": 0}
    first = asyncio.Event()
    done = asyncio.Event()

    async def read() -> None:
        nonlocal window_s
        try:
            async for chunk in request_iterator:
                totals["bytes"] += len(chunk.payload)
                if not first.is_set():
                    if chunk.window_s > 0:
                        window_s = min(max(chunk.window_s, MIN_WINDOW_S), MAX_WINDOW_S)
                    first.set()
        finally:
            first.set()
            done.set()

    reader = asyncio.create_task(read())
    try:
        await first.wait()
        start, seen = time.perf_counter(), totals["bytes"]
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), window_s)
            now, total = time.perf_counter(), totals["bytes"]
            yield agent_pb2.ProbeWindow(bytes=total - seen, seconds=now - start,
                                        total_bytes=total)
            start, seen = now, total
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
