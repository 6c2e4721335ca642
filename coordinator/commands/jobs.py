"""`coordinator submit`, `coordinator jobs`, `coordinator cancel JOB`: jobs for a running
coordinator, as `ray job submit` or `sbatch` give work to a running service.

`submit` takes the job flags of `coordinator start` (--model, --agents, the training flags;
coordinator/jobflags.py), or a TOML file of them (`--config FILE`, keys named like the flags;
the command line wins over the file), and sends the words: the coordinator parses them with
the same parser, so a submitted job means what the same flags mean at `start`. It checks
them here first, so a mistake is named before anything is sent.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

import grpc

from coordinator.commands.unary import call
from coordinator.daemon.operator import OPERATOR_FLAG
from coordinator.daemon.statusjson import job_state_name
from coordinator.jobflags import job_parser, parse_submitted, toml_args
from dtfm import flags, rpc
from protos.dtfm.v1 import coordinator_pb2


def add_cancel_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job_id", metavar="JOB", help="the job's id, as `coordinator jobs` lists it")
    p.add_argument("--reason", default="", help="why, for the job's record (200 characters)")


def job_words(argv: Sequence[str], client: argparse.ArgumentParser) -> list[str]:
    """The job flags among `submit`'s words (those `client`, the command's own flags, does
    not take), after the words of its --config TOML file (so the command line wins)."""
    known, words = client.parse_known_args(list(argv))
    return [*(toml_args(known.config, job_parser(), set(vars(known))) if known.config else []),
            *words]


def client_parser() -> argparse.ArgumentParser:
    """`submit`'s own flags (where to send it, how to print), apart from the job's."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--coordinator")
    for flag in ("--token-file", OPERATOR_FLAG, "--tls-cert", "--tls-key", "--tls-ca", "--timeout",
                 "--log-level", "--config"):
        p.add_argument(flag)
    p.add_argument("--json", action="store_true")
    return p


def submit(args: argparse.Namespace, argv: Sequence[str]) -> int:
    words = job_words(argv, client_parser())
    parse_submitted(words)  # ConfigError naming the flag, before anything is sent
    try:
        reply = flags.run_async(call(args, "SubmitJob",
                                      coordinator_pb2.SubmitJobRequest(args=words),
                                      operator=True))
    except grpc.aio.AioRpcError as exc:
        return flags.fail(rpc.describe_rpc_error(exc, args.coordinator), 1)
    print(json.dumps({"job_id": reply.job_id, "position": reply.position,
                      "message": reply.message}) if args.json else reply.message)
    return 0


def cancel(args: argparse.Namespace) -> int:
    try:
        reply = flags.run_async(call(args, "CancelJob", coordinator_pb2.CancelJobRequest(
            job_id=args.job_id, reason=args.reason), operator=True))
    except grpc.aio.AioRpcError as exc:
        return flags.fail(rpc.describe_rpc_error(exc, args.coordinator), 1)
    print(json.dumps({"job_id": args.job_id, "message": reply.message}) if args.json
          else reply.message)
    return 0


def list_jobs(args: argparse.Namespace) -> int:
    try:
        reply = flags.run_async(call(args, "ListJobs", coordinator_pb2.ListJobsRequest()))
    except grpc.aio.AioRpcError as exc:
        return flags.fail(rpc.describe_rpc_error(exc, args.coordinator), 1)
    rows = jobs_to_json(reply)
    print(json.dumps({"jobs": rows}) if args.json else jobs_to_text(rows))
    return 0


def jobs_to_json(jobs: coordinator_pb2.JobList) -> list[dict[str, Any]]:
    return [{"id": j.job_id, "state": job_state_name(j.state), "model": j.model,
             "agents": j.agents, "step": j.step, "total_steps": j.total_steps,
             "loss": j.loss, "message": j.message, "submitted_unix_s": j.submitted_unix_s,
             "args": list(j.args)} for j in jobs.jobs]


def jobs_to_text(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no jobs: `coordinator submit --model PRESET --agents N ...` queues one"
    lines = [f"{'JOB':<13} {'STATE':<11} {'MODEL':<12} {'AGENTS':>6} {'STEP':>11} "
             f"{'LOSS':>7}  SUBMITTED  MESSAGE"]
    for r in rows:
        at = (time.strftime("%H:%M:%S", time.localtime(r["submitted_unix_s"]))
              if r["submitted_unix_s"] else "at start")
        loss = f"{r['loss']:.3f}" if r["loss"] else "-"
        lines.append(f"{r['id']:<13} {r['state']:<11} {r['model'][:12]:<12} "
                     f"{r['agents']:>6} {r['step']:>5}/{r['total_steps']:<5} {loss:>7}  "
                     f"{at:<9}  {r['message'][:80]}")
    return "\n".join(lines)
