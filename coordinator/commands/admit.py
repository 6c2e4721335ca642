"""`coordinator admit AGENT_ID`: let an agent excluded for an integrity fault take part again.

A confirmed fault (coordinator/integrity/) excludes the agent from the job: its session ends
and its re-joins are refused until an operator admits it here. The evidence stays on record
(`coordinator status` shows it); a fault found again excludes it again.
"""

from __future__ import annotations

import argparse
import json

import grpc

from coordinator.commands.unary import call
from dtfm import flags, rpc
from protos.dtfm.v1 import coordinator_pb2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("agent_id", metavar="AGENT_ID",
                   help="the excluded agent's id, as `coordinator status` lists it")


async def admit(args: argparse.Namespace) -> int:
    try:
        reply = await call(args, "Admit", coordinator_pb2.AdmitRequest(agent_id=args.agent_id),
                           operator=True)
    except grpc.aio.AioRpcError as exc:
        return flags.fail(rpc.describe_rpc_error(exc, args.coordinator), 1)
    print(json.dumps({"agent": args.agent_id, "message": reply.message}) if args.json
          else reply.message)
    return 0


def run(args: argparse.Namespace) -> int:
    return flags.run_async(admit(args))
