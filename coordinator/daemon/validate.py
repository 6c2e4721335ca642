"""What the coordinator accepts from agents: every field of every request, bounded.

Each function answers why a request is unacceptable (a message for INVALID_ARGUMENT that says
what to fix) or None. The bounds themselves live in `dtfm.core.limits`, which agents also read.
Nothing here touches the registry: these are checks on one message alone.
"""

from __future__ import annotations

import math

from dtfm.core.breakdown import FIELDS as BREAKDOWN_FIELDS
from dtfm.core.limits import (
    AGENT_ID_RE,
    MAX_AGENTS,
    MAX_ERROR,
    MAX_EVIDENCE,
    MAX_KIND,
    MAX_LINK_WINDOWS,
    MAX_NAME,
    MAX_TUNING,
    MAX_VALIDATIONS,
    is_host,
    number_problem,
    text_problem,
)
from protos.dtfm.v1 import common_pb2, coordinator_pb2

WORKER_STATES = frozenset(common_pb2.WorkerState.values())  # the wire enum's numbers
DEVICE_KINDS = ("cpu", "cuda")
REACH_OVERRIDES = frozenset(common_pb2.ReachOverride.values())


def _first(*problems: str | None) -> str | None:
    return next((p for p in problems if p), None)


def agent_id_problem(agent_id: str, what: str = "agent_id") -> str | None:
    if AGENT_ID_RE.match(agent_id):
        return None
    shown = agent_id if len(agent_id) <= 80 else agent_id[:80] + "..."
    return (f"{what} {shown!r} is invalid: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit")


def secret_problem(secret: str) -> str | None:
    """Why an agent_secret is malformed (the coordinator issues 64 hex digits), or None."""
    if secret == "" or (len(secret) == 64 and all(c in "0123456789abcdef" for c in secret)):
        return None
    return ("agent_secret is not the 64 hex digits the coordinator issued: delete the "
            "agent-secret file in the agent's --state-dir")


def validate_agent_info(info: common_pb2.AgentInfo) -> str | None:
    """Why `info` is unacceptable, or None when it is fine."""
    problem = agent_id_problem(info.agent_id)
    if problem:
        return problem
    who = f"agent {info.agent_id}"
    if not is_host(info.host):
        shown = info.host if len(info.host) <= 80 else info.host[:80] + "..."
        return (f"{who}: host {shown!r} is not an IPv4/IPv6 address or a DNS host name; "
                "start the agent with --advertise set to its reachable address")
    if not 1 <= info.port <= 65535:
        return f"{who}: port {info.port} is outside 1..65535"
    if info.device.kind not in DEVICE_KINDS:
        return f"{who}: device kind {info.device.kind[:40]!r} is not 'cpu' or 'cuda'"
    if info.reachable not in REACH_OVERRIDES:
        return (f"{who}: reachable {info.reachable} is not a dtfm.v1.ReachOverride (auto, yes "
                "or no); is the agent newer than this coordinator?")
    return _first(
        text_problem(f"{who}: device name", info.device.name, MAX_NAME),
        text_problem(f"{who}: version", info.version, MAX_NAME),
        text_problem(f"{who}: device memory pool", info.device.memory_pool, MAX_NAME),
        number_problem(f"{who}: device flops", info.device.flops),
        number_problem(f"{who}: device bf16 flops", info.device.flops_bf16),
    )


def validate_progress(report: coordinator_pb2.ProgressReport) -> str | None:
    """Why a heartbeat is unacceptable, or None."""
    problem = agent_id_problem(report.agent_id) or secret_problem(report.agent_secret)
    if problem:
        return problem
    if report.worker_state not in WORKER_STATES:
        # proto3 enums are open: an unknown number decodes fine and must be refused here
        return (f"worker_state {report.worker_state} is not a dtfm.v1.WorkerState (one of "
                f"{min(WORKER_STATES)}..{max(WORKER_STATES)}); is the agent newer than "
                "this coordinator?")
    if len(report.mirrored_steps) > MAX_AGENTS:
        return (f"mirrored_steps names {len(report.mirrored_steps)} stages; a job has at "
                f"most {MAX_AGENTS}")
    if len(report.tuning) > MAX_TUNING:
        return f"tuning names {len(report.tuning)} settings; the limit is {MAX_TUNING}"
    if len(report.validations) > MAX_VALIDATIONS:
        return (f"validations holds {len(report.validations)} losses; the limit is "
                f"{MAX_VALIDATIONS} (a worker's newest)")
    if len(report.integrity) > MAX_EVIDENCE:
        return (f"integrity holds {len(report.integrity)} records; the limit is "
                f"{MAX_EVIDENCE} per heartbeat")
    if len(report.link_windows) > MAX_LINK_WINDOWS:
        return (f"link_windows holds {len(report.link_windows)} windows; the limit is "
                f"{MAX_LINK_WINDOWS} (a worker's newest)")
    return _first(
        *(number_problem(f"link_windows (step {w.step}): {name}", value)
          for w in report.link_windows for name in ("act_out", "act_in", "grad_out", "grad_in")
          if not math.isnan(value := getattr(w, name))),
        *(problem for e in report.integrity for problem in (
            text_problem("integrity kind", e.kind, MAX_KIND),
            text_problem(f"integrity {e.kind[:MAX_KIND]}: detail", e.detail, MAX_ERROR,
                         free_text=True),
            number_problem(f"integrity {e.kind[:MAX_KIND]}: score", e.score, None))),
        *(problem for t in report.tuning for problem in (
            text_problem("tuning setting", t.setting, MAX_NAME),
            text_problem(f"tuning {t.setting[:MAX_KIND]}: current", t.current, MAX_NAME),
            text_problem(f"tuning {t.setting[:MAX_KIND]}: wanted", t.wanted, MAX_NAME),
            text_problem(f"tuning {t.setting[:MAX_KIND]}: why", t.why, MAX_ERROR,
                         free_text=True))),
        number_problem("loss", report.loss, None),
        *(number_problem(f"validation loss of step {v.step}", v.loss)
          for v in report.validations),
        number_problem("tokens_per_s", report.tokens_per_s),
        *(number_problem(name, getattr(report, name))
          for name in ("step_s", "compute_s", "pp_wait_s", "dp_s", "drift")),
        # its parts: finite; `other` is what no timer held, a hair below 0 from rounding
        *(number_problem(f"breakdown.{name}", getattr(report.breakdown, name),
                         None if name == "other" else 0.0)
          for name in BREAKDOWN_FIELDS),
        text_problem("job_id", report.job_id, MAX_NAME),
        text_problem("error", report.error, MAX_ERROR, free_text=True),
        text_problem("error_kind", report.error_kind, MAX_KIND),
    )


def validate_leave(request: coordinator_pb2.LeaveRequest) -> str | None:
    """Why a goodbye is unacceptable, or None."""
    return _first(agent_id_problem(request.agent_id), secret_problem(request.agent_secret),
                  text_problem("reason", request.reason, MAX_ERROR, free_text=True))


def validate_link_report(report: coordinator_pb2.LinkReport) -> str | None:
    """Why a link report is unacceptable, or None."""
    problem = _first(agent_id_problem(report.agent_id), secret_problem(report.agent_secret),
                     text_problem("round_id", report.round_id, MAX_NAME))
    if problem:
        return problem
    if len(report.samples) > MAX_AGENTS:
        return f"{len(report.samples)} samples in one report; the limit is {MAX_AGENTS}"
    for s in report.samples:
        if not s.peer_id:
            return "a sample has no peer_id"
        problem = _first(
            agent_id_problem(s.peer_id, "sample peer_id"),
            number_problem(f"sample for {s.peer_id}: delay_ms", s.delay_ms),
            number_problem(f"sample for {s.peer_id}: bandwidth_gbps", s.bandwidth_gbps),
            number_problem(f"sample for {s.peer_id}: measured_unix_s", s.measured_unix_s),
            text_problem(f"sample for {s.peer_id}: error", s.error, MAX_ERROR, free_text=True),
            text_problem(f"sample for {s.peer_id}: estimate_note", s.estimate_note, MAX_ERROR,
                         free_text=True),
        )
        if problem:
            return problem
    return None


def validate_dial_report(report: coordinator_pb2.DialReport) -> str | None:
    """Why a dial-back report is unacceptable, or None."""
    return _first(agent_id_problem(report.agent_id), secret_problem(report.agent_secret),
                  text_problem("round_id", report.round_id, MAX_NAME),
                  agent_id_problem(report.peer_id, "peer_id"),
                  text_problem("error", report.error, MAX_ERROR, free_text=True))
