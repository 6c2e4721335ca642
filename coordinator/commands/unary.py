"""One unary call of the Coordinator service from a command line (`coordinator submit`,
`jobs`, `cancel`, `admit`): the channel from the command's --coordinator and security flags,
the command's --timeout (10 s by default), and for an operator call the operator token of
its --operator-token-file (coordinator/daemon/operator.py). The caller turns an
`AioRpcError` into its message."""

from __future__ import annotations

import argparse
from typing import Any

from coordinator.daemon.operator import (
    check_operator_token,
    load_operator_token,
    operator_metadata,
)
from dtfm import flags, rpc
from protos.dtfm.v1 import coordinator_pb2_grpc


async def call(args: argparse.Namespace, method: str, request: Any,
               operator: bool = False) -> Any:
    """`method`'s reply to `request` (`operator`: with the operator token, when one is
    given); raises grpc.aio.AioRpcError when the call fails."""
    security = flags.security_from_args(args)
    token = load_operator_token(args.operator_token_file) if operator else ""
    check_operator_token(token, security.token)
    async with rpc.open_channel(args.coordinator, security) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        return await getattr(stub, method)(request, timeout=args.timeout or 10.0,
                                           metadata=operator_metadata(token) or None)
