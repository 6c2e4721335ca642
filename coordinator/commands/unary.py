"""One unary call of the Coordinator service from a command line (`coordinator submit`,
`jobs`, `cancel`, `admit`): the channel from the command's --coordinator and security flags,
the command's --timeout (10 s by default). The caller turns an `AioRpcError` into its message."""

from __future__ import annotations

import argparse
from typing import Any

from dtfm import flags, rpc
from protos.dtfm.v1 import coordinator_pb2_grpc


async def call(args: argparse.Namespace, method: str, request: Any) -> Any:
    """`method`'s reply to `request`; raises grpc.aio.AioRpcError when the call fails."""
    async with rpc.open_channel(args.coordinator, flags.security_from_args(args)) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        return await getattr(stub, method)(request, timeout=args.timeout or 10.0)
