"""Bounds on what crosses the wire: string lengths, list sizes, address syntax.

The coordinator refuses a message past these bounds with INVALID_ARGUMENT; agents keep under
them (`clip`) so a long worker traceback never costs a heartbeat. Pure Python: no grpc, no
generated messages, so both programs and their tests import it freely.
"""

from __future__ import annotations

import ipaddress
import math
import re

AGENT_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_LABEL_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")

MAX_AGENTS = 10_000  # registry rows, in any state; joins past it get RESOURCE_EXHAUSTED
MAX_STATUS_AGENTS = 256  # agent rows (and link-matrix size) one GetStatus answer carries
MAX_HOST = 253  # RFC 1123: a DNS name's length
MAX_NAME = 256  # device name, version, job and round ids
MAX_ERROR = 4096  # free-text error strings (worker failures, unreachable links)
MAX_KIND = 32  # short enum-like strings (error_kind)
MAX_PING_SPREAD_S = 60.0  # a latency pass's pings to one peer spread over at most this long
# Pings to one peer start this far apart where a command gives no spread, each at a random
# point of its slot (agent/probing/linkprobe.py): pings fired together queue in the agents' event
# loops (on 2 cores, 8 agents pinging 7 peers every 10 ms read 11 ms links 1.7 ms long). The
# coordinator paces against it (coordinator/links/measure.py, `Pings.spread_for`).
PING_SPACING_S = 0.1
MAX_TUNING = 16  # kernel settings one heartbeat advises on (agent/probing/tuning.py checks 5)
MAX_VALIDATIONS = 8  # validation losses one heartbeat carries: its worker's newest
MAX_EVIDENCE = 16  # integrity evidence records one heartbeat carries: the oldest not yet sent
MAX_LINK_WINDOWS = 16  # pipeline-link windows one heartbeat carries: its worker's newest
# records an agent holds for the coordinator until a heartbeat carries them (past it, a
# worker's newer records are dropped and counted: the oldest hold the onset of an attack,
# which bounds the rollback)
MAX_PENDING_EVIDENCE = 1024
OMITTED_METADATA = "dtfm-agents-omitted"  # GetStatus trailer: agent rows left out


def clip(text: str, limit: int = MAX_ERROR) -> str:
    """`text` cut to `limit` characters, keeping its end (where a traceback says what broke)."""
    return text if len(text) <= limit else "..." + text[-(limit - 3):]


def finite(value: float, bound: float = 1e300) -> float:
    """`value` clamped into [-bound, bound], NaN as 0: a number the wire's checks accept
    (a score of infinity, say, still reads as huge)."""
    return 0.0 if math.isnan(value) else max(-bound, min(bound, value))


def is_host(host: str) -> bool:
    """An IPv4/IPv6 literal, or a DNS host name per RFC 1123 (not an all-numeric one)."""
    if not host or len(host) > MAX_HOST:
        return False
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    labels = host.removesuffix(".").split(".")
    if not all(_LABEL_RE.match(label) for label in labels):
        return False
    return not labels[-1].isdigit()  # 256.256.256.256 is a bad address, not a name


def text_problem(what: str, value: str, limit: int, free_text: bool = False) -> str | None:
    """Why `value` is unacceptable as `what`, or None. Free text may hold newlines and tabs."""
    if len(value) > limit:
        return f"{what} is {len(value)} characters long; the limit is {limit}"
    allowed = "\n\t" if free_text else ""
    bad = next((c for c in value if (c < " " and c not in allowed) or c == "\x7f"), None)
    if bad is not None:
        return f"{what} contains the control character {bad!r}"
    return None


def number_problem(what: str, value: float, minimum: float | None = 0.0) -> str | None:
    """Why `value` is unacceptable as `what` (finite, and >= `minimum` unless None), or None."""
    if not math.isfinite(value):
        return f"{what} must be a finite number, got {value!r}"
    if minimum is not None and value < minimum:
        return f"{what} must be >= {minimum:g}, got {value!r}"
    return None
