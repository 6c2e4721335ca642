"""`coordinator` entry point: parse flags into the typed config, call one function."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import Sequence

import grpc

from coordinator.daemon import pace
from dtfm import flags, rpc
from dtfm.core.limits import (
    MAX_PING_SPREAD_S,
    MAX_STATUS_AGENTS,
)

DEFAULT_LISTEN = "127.0.0.1:7070"


def _add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", default=DEFAULT_LISTEN, help="HOST:PORT of the coordinator")
    flags.add_security_args(p)
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.add_argument("--timeout", type=flags.seconds, default=None,
                   help="seconds to wait for an answer (default 10; 600 for links --measure)")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    from coordinator.daemon.operator import add_operator_arg
    from coordinator.jobflags import add_job_args  # `plan` below loads numpy anyway
    from coordinator.web.server import DEFAULT_WEB

    parser = flags.Parser(
        prog="coordinator",
        description="dtfm coordinator: registry, link matrix, scheduler and job control",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    subs: dict[str, argparse.ArgumentParser] = {}

    p = subs["start"] = sub.add_parser("start", help="run the coordinator daemon")
    p.add_argument("--listen", default=DEFAULT_LISTEN, help="HOST:PORT to serve on")
    flags.add_security_args(p)
    add_operator_arg(p, server=True)
    p.add_argument("--heartbeat-interval", type=flags.seconds, default=1.0, help="seconds")
    p.add_argument("--heartbeat-budget", type=float, default=pace.DEFAULT_BUDGET,
                   help="heartbeats a second the coordinator takes in (%(default)g): with "
                   "more agents than that times --heartbeat-interval, the interval and "
                   "--liveness-timeout stretch with their number; 0: a fixed interval")
    p.add_argument("--liveness-timeout", type=flags.seconds, default=flags.LIVENESS_TIMEOUT_S,
                   help="seconds without heartbeat before an agent is marked lost "
                   "(%(default)g; docs/operations.md, \"Liveness\")")
    p.add_argument("--evict-after", type=flags.seconds, default=600.0,
                   help="seconds an agent may stay lost or left before it is dropped from "
                   "the registry (and from status)")
    p.add_argument("--measure-timeout", type=flags.seconds, default=120.0,
                   help="seconds a whole link measurement may take")
    p.add_argument("--measure-every", type=flags.seconds_or_off, default=0.0,
                   help="re-measure all links this often (s) while no job trains; 0: off")
    add_job_args(p)  # --model, --agents, ... and the training flags (jobflags.py)
    p.add_argument("--relay-port", type=flags.number(int, 0, maximum=65535), default=None,
                   metavar="PORT", help="a port of its own for the data-plane relay for agents "
                   "that cannot accept connections, on the --listen host (default: the relay "
                   "shares the --listen port, one port to open; 0: no relay)")
    p.add_argument("--checkpoint-store-mib", type=flags.number(float, 0), default=4096,
                   metavar="MIB", help="the most disk the coordinator gives to copies of "
                   "stage checkpoints when no agent of the job can be dialled (their holders "
                   "push them here, the newest step of each stage; 0: keep none)")
    p.add_argument("--state-dir", default="", metavar="DIR",
                   help="keep the job's identity, plan and recoveries here (sqlite), so a "
                   "restarted coordinator continues the job from the agents' checkpoints")
    p.add_argument("--metrics-listen", default="", metavar="HOST:PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (default: off)")
    p.add_argument("--web", nargs="?", const=DEFAULT_WEB, default="", metavar="HOST:PORT",
                   help="serve a live web view of the cluster and job at http://HOST:PORT/ "
                   f"(https with --tls-cert; alone: {DEFAULT_WEB}; default: off); open the URL "
                   "`coordinator web-url` prints: it logs the browser in with the join token once")
    p.add_argument("--tensorboard", default="", metavar="DIR",
                   help="write the job's scalars (loss, tokens/s, step time measured and "
                   "predicted, bytes per step, recoveries, re-plans) as TensorBoard event files "
                   "in DIR (needs pip install 'dtfm[tensorboard]'; default: off)")
    flags.add_common_args(p)

    p = subs["status"] = sub.add_parser("status", help="show agents, job and plan")
    _add_client_args(p)
    p.add_argument("--watch", type=flags.seconds, nargs="?", const=2.0, default=None,
                   metavar="SECONDS", help="redraw every SECONDS (default 2) until Ctrl-C; with "
                   "--json, print one JSON line per refresh")
    p.add_argument("--all", action="store_true",
                   help="also list every job: ended, running and queued (`coordinator jobs`)")
    flags.add_common_args(p, config_file=False)

    from coordinator.commands import jobs

    p = subs["submit"] = sub.add_parser(
        "submit", help="queue a job on the running coordinator: the job flags of `start` "
        "(--model, --agents, the training flags), or --config FILE.toml holding them")
    _add_client_args(p)
    add_operator_arg(p, server=False)
    add_job_args(p)
    flags.add_common_args(p)
    p = subs["jobs"] = sub.add_parser(
        "jobs", help="list the coordinator's jobs: ended, running and queued")
    _add_client_args(p)
    flags.add_common_args(p, config_file=False)
    p = subs["cancel"] = sub.add_parser(
        "cancel", help="cancel a queued job, or stop the running one (the next one starts)")
    _add_client_args(p)
    add_operator_arg(p, server=False)
    jobs.add_cancel_arguments(p)
    flags.add_common_args(p, config_file=False)

    from coordinator.commands import admit

    p = subs["admit"] = sub.add_parser(
        "admit", help="let an agent excluded for an integrity fault take part again")
    _add_client_args(p)
    add_operator_arg(p, server=False)
    admit.add_arguments(p)
    flags.add_common_args(p, config_file=False)

    p = subs["report"] = sub.add_parser(
        "report", help="the job's loss and throughput by step (a table, --json or --plot)")
    _add_client_args(p)
    p.add_argument("--plot", metavar="FILE.png", default="",
                   help="also draw loss and throughput by step into this PNG (needs matplotlib: "
                   "pip install 'dtfm[plot]')")
    p.add_argument("--job", default="", metavar="ID",
                   help="a job `coordinator jobs` lists: the running one (default) or one of "
                   "the newest ended ones")
    flags.add_common_args(p, config_file=False)

    p = subs["export"] = sub.add_parser(
        "export", help="write a job's newest complete step as a Hugging Face model directory, "
        "gathered from the agents that hold its stages")
    _add_client_args(p)
    p.add_argument("--job", default="", metavar="ID",
                   help="the job id `coordinator status` shows (default: the running job)")
    p.add_argument("--out", required=True, metavar="DIR", help="the directory to write")
    p.add_argument("--force", action="store_true", help="replace --out if it is not empty")
    p.add_argument("--tokenizer", default="", metavar="PATH",
                   help="tokenizer.json (or a directory holding one) to write beside the model")
    p.add_argument("--merged", action="store_true",
                   help="a LoRA job: write its base with the adapters merged in (needs torch "
                   "and the base here) instead of the peft adapter directory")
    flags.add_common_args(p, config_file=False)

    p = subs["links"] = sub.add_parser(
        "links", help="print the measured link matrix (the --links format of `plan`)")
    _add_client_args(p)
    p.add_argument("--measure", action="store_true",
                   help="measure all live agents' links now and wait for the result")
    p.add_argument("--sampled", action="store_true",
                   help="with --measure: latency of every pair, bandwidth only for one link "
                   "per pair of latency clusters (the rest inferred, marked as estimates); "
                   "for many agents, where all pairs take minutes")
    p.add_argument("--ping-spread", type=flags.number(float, 0, maximum=MAX_PING_SPREAD_S,
                                                       unit=" seconds"),
                   default=0.0, metavar="SECONDS",
                   help="with --measure: spread each agent's pings to each peer over at least "
                   "this long (default: a tenth of a second apart, or longer where an agent "
                   "would send more than 20 pings a second); for many agents on few cores, "
                   "whose pings fired together queue in their own event loops")
    flags.add_common_args(p, config_file=False)

    try:
        from coordinator.commands import plan as plan_cmd
    except ImportError:  # pragma: no cover - the scheduler is part of the package
        plan_cmd = None
    if plan_cmd is not None:
        p = subs["plan"] = sub.add_parser(
            "plan", help="run the scheduler offline on a scenario or a measured matrix")
        plan_cmd.add_arguments(p)

    from coordinator.commands import demo

    p = subs["demo"] = sub.add_parser(
        "demo", help="a local cluster on loopback (coordinator + agents) training a small GPT")
    demo.add_arguments(p)

    from coordinator.commands import weburl

    p = subs["web-url"] = sub.add_parser(
        "web-url", help="print the URL that opens the coordinator's web view (--web) logged in")
    weburl.add_arguments(p, DEFAULT_WEB)

    from coordinator.commands import certs

    p = subs["certs"] = sub.add_parser(
        "certs", help="make the cluster's TLS CA (certs ca) and sign node certificates "
        "(certs node) for --tls-cert/--tls-key/--tls-ca")
    certs.add_arguments(p)
    return parser, subs


def main(argv: Sequence[str] | None = None) -> int:
    parser, subs = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)  # `submit` sends its job's words

    def plan(args: argparse.Namespace) -> int:
        from coordinator.commands import plan as plan_cmd

        return plan_cmd.run(args)

    def demo(args: argparse.Namespace) -> int:
        from coordinator.commands import demo as demo_cmd

        return demo_cmd.run(args)

    def query(args: argparse.Namespace) -> int:
        if getattr(args, "watch", None) is None:
            return flags.run_async(_query(args))
        try:
            return flags.run_async(_watch(args))
        except KeyboardInterrupt:  # Ctrl-C is how a watch ends
            return 0

    def certs(args: argparse.Namespace) -> int:
        from coordinator.commands import certs as certs_cmd

        return certs_cmd.run(args)

    def web_url(args: argparse.Namespace) -> int:
        from coordinator.commands.weburl import run

        return run(args)

    def admit_cmd(args: argparse.Namespace) -> int:
        from coordinator.commands.admit import run

        return run(args)

    def report(args: argparse.Namespace) -> int:
        from coordinator.commands.report import run

        return run(args)

    from coordinator.commands import jobs

    return flags.dispatch(parser, subs, words, {
        "submit": lambda args: jobs.submit(args, words[1:]), "jobs": jobs.list_jobs,
        "cancel": jobs.cancel,
        "start": _start, "status": query, "links": query, "plan": plan, "demo": demo,
        "report": report, "certs": certs, "web-url": web_url, "admit": admit_cmd,
        "export": lambda args: flags.run_async(_export(args))})


def _start(args: argparse.Namespace) -> int:
    from coordinator.daemon.config import CoordinatorConfig
    from coordinator.daemon.operator import load_operator_token
    from coordinator.daemon.server import serve
    from coordinator.jobflags import job_config

    config = CoordinatorConfig(
        listen=args.listen,
        security=flags.security_from_args(args),
        operator_token=load_operator_token(args.operator_token_file),
        heartbeat_interval_s=args.heartbeat_interval,
        heartbeat_budget=args.heartbeat_budget,
        liveness_timeout_s=args.liveness_timeout,
        evict_after_s=args.evict_after,
        measure_timeout_s=args.measure_timeout,
        measure_every_s=args.measure_every,
        metrics_listen=args.metrics_listen,
        web_listen=args.web,
        tensorboard_dir=args.tensorboard,
        state_dir=args.state_dir,
        relay_port=args.relay_port,
        checkpoint_store_bytes=int(args.checkpoint_store_mib * 2**20),
        job=job_config(args),
    )
    config.validate()
    flags.run_async(serve(config))
    return 0


async def _export(args: argparse.Namespace) -> int:
    from coordinator.job.export import export_job
    from dtfm.core.hfexport import ExportError

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        step, out = await export_job(args.coordinator, flags.security_from_args(args), args.out,
                                     job_id=args.job, force=args.force,
                                     tokenizer=args.tokenizer, merged=args.merged, say=say)
    except ExportError as exc:
        return flags.fail(str(exc), 1)
    print(json.dumps({"out": str(out), "step": step}) if args.json
          else f"exported step {step} to {out}")
    return 0


async def _query(args: argparse.Namespace) -> int:
    from coordinator.commands.jobs import jobs_to_json, jobs_to_text
    from coordinator.commands.status import omitted_agents, status_to_json, status_to_text
    from coordinator.links.store import matrix_to_json
    from protos.dtfm.v1 import coordinator_pb2, coordinator_pb2_grpc

    security = flags.security_from_args(args)
    async with rpc.open_channel(args.coordinator, security) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        try:
            if args.command == "links":
                if args.measure:
                    budget = args.timeout or 600.0
                    matrix = await stub.MeasureLinks(
                        coordinator_pb2.MeasureRequest(timeout_s=budget, sampled=args.sampled,
                                                       ping_spread_s=args.ping_spread),
                        timeout=budget + 10)
                else:
                    matrix = (await stub.GetStatus(coordinator_pb2.StatusRequest(),
                                                   timeout=args.timeout or 10.0)).links
                data = matrix_to_json(matrix)
                if not data["agents"]:
                    return flags.fail("no links measured yet: run `coordinator links "
                                        "--measure` once agents have joined", 1)
                print(json.dumps(data) if args.json else _links_text(data))
                return 0
            call = stub.GetStatus(coordinator_pb2.StatusRequest(),
                                  timeout=args.timeout or 10.0)
            status = await call
            omitted = omitted_agents(await call.trailing_metadata())
            jobs = (jobs_to_json(await stub.ListJobs(coordinator_pb2.ListJobsRequest(),
                                                     timeout=args.timeout or 10.0))
                    if args.all else None)
        except grpc.aio.AioRpcError as exc:
            return flags.fail(rpc.describe_rpc_error(exc, args.coordinator), 1)
    if args.json:
        print(json.dumps({**status_to_json(status), "agents_omitted": omitted,
                          **({"jobs": jobs} if jobs is not None else {})}))
    else:
        print(status_to_text(status) + (f"\n({omitted} more agents not shown: a status "
                                        f"lists at most {MAX_STATUS_AGENTS})" if omitted else "")
              + (f"\n\njobs:\n{jobs_to_text(jobs)}" if jobs is not None else ""))
    return 0


WATCH_FATAL = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
               grpc.StatusCode.UNIMPLEMENTED)


async def _watch(args: argparse.Namespace) -> int:
    """`status --watch`: redraw until Ctrl-C; keep retrying while the coordinator is away.

    Ctrl-C is the loop's own signal handler: it ends the redraw in flight (a status call or
    the sleep) and the channel's close is bounded, so the command exits at once however busy
    the machine or the coordinator (a watch on a loaded CI machine once outlived 10 s after
    its Ctrl-C)."""
    from coordinator.commands.status import status_to_json, status_to_text, watch_frame
    from protos.dtfm.v1 import coordinator_pb2, coordinator_pb2_grpc

    body, main = "", asyncio.current_task()
    stopped = asyncio.Event()

    def stop() -> None:
        stopped.set()
        if main is not None:
            main.cancel()

    asyncio.get_running_loop().add_signal_handler(signal.SIGINT, stop)
    channel = rpc.open_channel(args.coordinator, flags.security_from_args(args))
    try:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        while True:
            error = ""
            try:
                status = await stub.GetStatus(coordinator_pb2.StatusRequest(),
                                              timeout=args.timeout or 10.0)
                body = (json.dumps(status_to_json(status)) if args.json
                        else status_to_text(status))
            except grpc.aio.AioRpcError as exc:
                error = rpc.describe_rpc_error(exc, args.coordinator)
                if exc.code() in WATCH_FATAL:
                    return flags.fail(error, 1)
            if args.json:
                print(json.dumps({"error": error}) if error else body, flush=True)
            else:
                sys.stdout.write(watch_frame(body, args.watch, args.coordinator, error))
                sys.stdout.flush()
            await asyncio.sleep(args.watch)
    except asyncio.CancelledError:
        if not stopped.is_set():
            raise
        return 0
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(channel.close(grace=None), 2.0)


def _links_text(data: dict) -> str:
    ids = data["agents"]
    width = max(8, *(len(i) for i in ids))
    lines = ["one-way delay (ms), row = from, column = to"]
    lines.append(" " * width + "".join(i[-10:].rjust(12) for i in ids))
    for i, row in zip(ids, data["delay_ms"], strict=True):
        lines.append(i.ljust(width) + "".join(
            ("-" if v is None else f"{v:.2f}").rjust(12) for v in row))
    lines.append("bandwidth (Gbit/s)")
    for i, row in zip(ids, data["bandwidth_gbps"], strict=True):
        lines.append(i.ljust(width) + "".join(
            ("-" if v is None else f"{v:.4f}").rjust(12) for v in row))
    if data["unreachable"]:
        lines.append("unreachable: " + ", ".join(data["unreachable"]))
    for pair, note in data.get("estimated", {}).items():
        lines.append(f"estimated bandwidth {pair}: {note}")
    return "\n".join(lines)
