"""`agent` entry point: parse flags into the typed config, call one function."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import grpc

from dtfm import flags, rpc
from dtfm.checkpoints.copies import MIRROR_INTERVAL_S


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = flags.Parser(
        prog="agent", description="dtfm agent: joins a coordinator, measures links, trains")
    sub = parser.add_subparsers(dest="command", required=True)
    subs: dict[str, argparse.ArgumentParser] = {}

    p = subs["start"] = sub.add_parser("start", help="run the agent daemon")
    p.add_argument("--coordinator", default="127.0.0.1:7070", help="HOST:PORT of the coordinator")
    p.add_argument("--listen", default="127.0.0.1:0",
                   help="HOST:PORT for this agent's own service (port 0: any free port)")
    p.add_argument("--advertise", default="",
                   help="host peers use to reach this agent (default: the --listen host)")
    p.add_argument("--state-dir", default=None,
                   help="keeps the agent id and worker files (env DTFM_STATE_DIR); each agent "
                   "on one machine needs its own")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--bind-interface", default="",
                   help="network interface the training worker's collectives (gloo, NCCL "
                   "bootstrap) use; default: the one holding the --advertise address")
    p.add_argument("--no-prewarm", dest="prewarm", action="store_false",
                   help="start each training worker when its assignment arrives instead of "
                   "keeping one spare worker with torch imported (env DTFM_PREWARM=0)")
    p.add_argument("--mirror-interval", type=flags.number(float, 0.1, maximum=3600, unit=" s"),
                   default=MIRROR_INTERVAL_S, metavar="SECONDS",
                   help="how often this agent asks a peer for new checkpoints of a stage it "
                   "mirrors (a one-replica stage's second copy; default %(default)g)")
    p.add_argument("--metrics-listen", default="", metavar="HOST:PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (default: off)")
    p.add_argument("--flops", type=flags.number(float, 0, maximum=1e18, unit=" FLOP/s"),
                   default=0.0, help="report this sustained FLOP/s (in the training dtype) "
                   "instead of measuring it; the coordinator gives faster devices more layers "
                   "(0: measure, the default)")
    p.add_argument("--memory", type=flags.number(int, 0, maximum=2**63 - 1), default=0,
                   metavar="BYTES", help="report this many bytes of device memory free for "
                   "training instead of detecting it (0: detect, the default)")
    p.add_argument("--reachable", default="auto", choices=["auto", "yes", "no"],
                   help="whether peers can dial this agent at --advertise (env "
                   "DTFM_REACHABLE): auto, the default, has the coordinator and a few peers "
                   "dial it back when it joins and logs what they found; yes or no overrides "
                   "that, for the operator who knows better")
    p.add_argument("--data-port", type=flags.number(int, 0, maximum=65535), default=0,
                   metavar="PORT", help="a TCP port of its own on which the training worker "
                   "accepts the dtfm data plane, at --advertise, when peers can dial this "
                   "agent (default 0: the --listen port itself, shared with gRPC: one port)")
    p.add_argument("--relay", action="store_true",
                   help="serve a dtfm relay on the --listen port, where two agents of this "
                   "agent's jobs that nobody can dial may meet; used only while peers can "
                   "dial this agent (default: no relay)")
    p.add_argument("--relay-port", type=flags.number(int, 0, maximum=65535), default=0,
                   metavar="PORT", help="serve that relay on a TCP port of its own instead "
                   "(default 0: none, or the --listen port with --relay)")
    flags.add_security_args(p)
    flags.add_common_args(p)

    p = subs["status"] = sub.add_parser("status", help="ask one agent how it is")
    p.add_argument("--agent", required=True, help="HOST:PORT of the agent")
    flags.add_security_args(p)
    p.add_argument("--json", action="store_true")
    flags.add_common_args(p, config_file=False)

    try:
        from agent.commands import local
    except ImportError:  # pragma: no cover - the runtime is part of the package
        local = None
    if local is not None:
        p = subs["local"] = sub.add_parser(
            "local", help="train on this machine: S x R worker processes, like torchrun "
            "--standalone")
        local.add_arguments(p)

    from agent.commands import generate

    p = subs["generate"] = sub.add_parser(
        "generate", help="continue a prompt with a Hugging Face model directory's weights, "
        "computed by dtfm's own model")
    generate.add_arguments(p)

    from agent.commands import prepare

    p = subs["prepare"] = sub.add_parser(
        "prepare", help="tokenize .txt, .jsonl or .parquet files into the train.bin, val.bin "
        "and meta.json that --data trains on")
    prepare.add_arguments(p)
    return parser, subs


def main(argv: Sequence[str] | None = None) -> int:
    parser, subs = build_parser()

    def local(args: argparse.Namespace) -> int:
        from agent.commands import local as local_cmd

        return local_cmd.run(args)

    def status(args: argparse.Namespace) -> int:
        return flags.run_async(_status(args))

    def generate(args: argparse.Namespace) -> int:
        from agent.commands import generate as generate_cmd

        return generate_cmd.run(args)

    def prepare(args: argparse.Namespace) -> int:
        from agent.commands import prepare as prepare_cmd

        return prepare_cmd.run(args)

    return flags.dispatch(parser, subs, argv, {"start": _start, "status": status,
                                               "local": local, "generate": generate,
                                               "prepare": prepare})


def _start(args: argparse.Namespace) -> int:
    from agent.daemon.config import AgentConfig, default_state_dir
    from agent.daemon.server import serve

    config = AgentConfig(
        coordinator=args.coordinator, listen=args.listen, advertise=args.advertise,
        state_dir=args.state_dir or default_state_dir(),
        security=flags.security_from_args(args), device=args.device,
        bind_interface=args.bind_interface, metrics_listen=args.metrics_listen,
        flops=args.flops, memory=args.memory, prewarm=args.prewarm,
        mirror_interval_s=args.mirror_interval, reachable=args.reachable,
        data_port=args.data_port, relay=args.relay, relay_port=args.relay_port,
    )
    config.validate()
    return flags.run_async(serve(config))


async def _status(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    from dtfm.core.workerstate import WorkerState
    from protos.dtfm.v1 import agent_pb2, agent_pb2_grpc

    async with rpc.open_channel(args.agent, flags.security_from_args(args)) as channel:
        try:
            reply = await agent_pb2_grpc.AgentStub(channel).GetStatus(
                agent_pb2.AgentStatusRequest(), timeout=10.0)
        except grpc.aio.AioRpcError as exc:
            return flags.fail(rpc.describe_rpc_error(exc, args.agent), 1)
    data = MessageToDict(reply, preserving_proto_field_name=True)
    # the lowercase name, as before the state was an enum on the wire
    data["worker_state"] = state = WorkerState.label(reply.worker_state)
    if args.json:
        print(json.dumps(data))
    else:
        print(f"agent {reply.info.agent_id} at {reply.info.host}:{reply.info.port} "
              f"({reply.info.device.kind}); coordinator {reply.coordinator} "
              f"{'connected' if reply.connected else 'NOT connected'}; worker "
              f"{state}" + (f" job {reply.job_id} step {reply.step}" if reply.job_id else ""))
        if reply.HasField("reach"):
            print(f"  {reply.reach.summary}")
    return 0
