"""Keep one background copy going: call it every interval, whatever fails, and say so once.

Checkpoint mirrors (pulled from a peer) and pushes (sent by an agent nobody can dial) run for
as long as the assignment that asked for them, against peers that come and go. A failure is
logged when it starts and again when it ends, not on every retry, so a peer that is gone for
an hour costs two log lines rather than one a minute.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from dtfm import rpc


async def every(interval_s: float, once: Callable[[], Awaitable[Any]], what: str,
                address: str, log: logging.Logger) -> None:
    """Run `once` every `interval_s` until cancelled; `what` names it in `log`'s lines
    ("mirror stage 1 of job j from HOST:PORT")."""
    failing = False
    while True:
        try:
            await once()
            if failing:
                log.info("checkpoint: %s works again", what)
            failing = False
        except Exception as e:  # noqa: BLE001 - a background copy retries, whatever failed
            if not failing:
                why = rpc.describe_rpc_error(e, address) if isinstance(e, grpc.RpcError) \
                    else repr(e)
                log.warning("checkpoint: cannot %s: %s; retrying every %g s", what, why,
                            interval_s)
            failing = True
        await asyncio.sleep(interval_s)


async def cancel_all(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel `tasks` (loops of `every`) and wait until each has stopped."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
