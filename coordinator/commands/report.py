"""`coordinator report`: a job's loss and throughput by step, from a running coordinator.

Owns the command: one `GetHistory` call, then a table, `--json`, and with `--plot FILE.png`
a picture drawn by `coordinator/commands/plots.py` (matplotlib is imported only then).
"""

from __future__ import annotations

import argparse
import json
import sys

import grpc

from coordinator.daemon.history import history_to_json, history_to_text
from dtfm import flags, rpc
from protos.dtfm.v1 import coordinator_pb2, coordinator_pb2_grpc


async def fetch(args: argparse.Namespace) -> coordinator_pb2.JobHistory | str:
    """The coordinator's history, or why it could not be had."""
    async with rpc.open_channel(args.coordinator, flags.security_from_args(args)) as channel:
        try:
            return await coordinator_pb2_grpc.CoordinatorStub(channel).GetHistory(
                coordinator_pb2.HistoryRequest(job_id=args.job), timeout=args.timeout or 10.0)
        except grpc.aio.AioRpcError as exc:
            return rpc.describe_rpc_error(exc, args.coordinator)


def write_plot(data: dict, path: str) -> str:
    """Draw the history into `path`; returns an error message, or "" on success."""
    if not data["points"]:
        return "no steps recorded yet, so nothing to plot: wait for the job to train"
    try:
        from coordinator.commands.plots import plot_history
    except ImportError as exc:
        return f"--plot needs matplotlib ({exc}): pip install 'dtfm[plot]'"
    try:
        plot_history(data, path)
    except OSError as exc:
        return f"cannot write {path}: {exc.strerror}"
    return ""


def run(args: argparse.Namespace) -> int:
    history = flags.run_async(fetch(args))
    if isinstance(history, str):
        return flags.fail(history, 1)
    data = history_to_json(history)
    print(json.dumps(data) if args.json else history_to_text(data))
    if args.plot:
        problem = write_plot(data, args.plot)
        if problem:
            return flags.fail(problem, 1)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
