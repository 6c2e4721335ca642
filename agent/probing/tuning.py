"""Checks the kernel settings that decide how fast this host's long TCP links can run.

`deploy/sysctl.d/60-dtfm-wan.conf` sets them and only `deploy/install.sh` applies it, so an
agent started by hand (README, "Running a real cluster") runs with Linux's defaults, and on an
8-host emulated WAN the scheduled placement then took 1.26 s a step instead of 1.08 s (17 %
slower) without a word. The agent checks at start (`tcp_slow_start_after_idle`) and again after
every measurement of its links (the TCP buffer maxima against the bandwidth-delay products it
measured), and says what to change once, in its log and on its heartbeat
(`ProgressReport.tuning`), which `coordinator status` shows.

Reads `/proc/sys` under `root`, a parameter so tests feed it a directory of fake values. A
setting the host does not expose (another OS, a restricted container) is not advised on.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from protos.dtfm.v1 import common_pb2

log = logging.getLogger(__name__)

PROC_SYS = Path("/proc/sys")
CONF = "deploy/sysctl.d/60-dtfm-wan.conf"
HOW = (f"apply {CONF} (deploy/install.sh installs it; by hand: copy it to /etc/sysctl.d/ and "
       "run `sudo sysctl --system`)")
# What the conf file sets (tests/agent/test_tuning.py keeps the two equal).
WANTED = {
    "net.core.rmem_max": "67108864",
    "net.core.wmem_max": "67108864",
    "net.ipv4.tcp_rmem": "4096 131072 67108864",
    "net.ipv4.tcp_wmem": "4096 65536 67108864",
    "net.ipv4.tcp_slow_start_after_idle": "0",
}
SLOW_START_COST = ("every burst after an idle gap (a step's activations, its gradient "
                   "all-reduce) restarts TCP slow start and regrows its window over several "
                   "round trips: on an 8-host emulated WAN steps took 17 % longer untuned "
                   "(1.26 s against 1.08 s)")
# Linux gives TCP's window about half of a socket buffer (tcp_adv_win_scale = 1); the rest
# is bookkeeping. A buffer of twice the bandwidth-delay product lets one stream fill its link.
WINDOW_SHARE = 0.5


@dataclass(frozen=True)
class Advice:
    """One setting to change: `line` is the sysctl line that fixes it."""

    setting: str
    current: str
    wanted: str
    why: str

    @property
    def line(self) -> str:
        return f"{self.setting} = {self.wanted}"

    def to_proto(self) -> common_pb2.TuningAdvice:
        return common_pb2.TuningAdvice(setting=self.setting, current=self.current,
                                       wanted=self.wanted, why=self.why)


@dataclass(frozen=True)
class Link:
    """A measured link of this host: the round trip and the rate it carried."""

    peer_id: str
    rtt_s: float
    bits_per_s: float

    @property
    def bdp_bytes(self) -> float:
        return self.rtt_s * self.bits_per_s / 8


def read_sysctl(root: Path, key: str) -> str | None:
    """The value of `key` (dotted) under `root`, whitespace-normalized; None when absent."""
    try:
        text = (root / key.replace(".", "/")).read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError):
        return None
    return " ".join(text.split()) or None


def _maximum(value: str) -> int | None:
    """The largest size a setting allows: the value itself, or the third of `min def max`."""
    try:
        return int(value.split()[-1])
    except (ValueError, IndexError):
        return None


def check(root: Path = PROC_SYS, links: Iterable[Link] = ()) -> list[Advice]:
    """What to change on this host; empty when it is tuned for `links` (or nothing is known).

    Without links only `tcp_slow_start_after_idle` is judged: the buffers' maxima matter
    only against a link's bandwidth-delay product, which a measurement gives.
    """
    advice = []
    key = "net.ipv4.tcp_slow_start_after_idle"
    current = read_sysctl(root, key)
    if current is not None and current != WANTED[key]:
        advice.append(Advice(key, current, WANTED[key], SLOW_START_COST))
    widest = max(links, key=lambda link: link.bdp_bytes, default=None)
    if widest is None or widest.bdp_bytes <= 0:
        return advice
    need = widest.bdp_bytes / WINDOW_SHARE
    for key in ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem", "net.core.rmem_max",
                "net.core.wmem_max"):
        current = read_sysctl(root, key)
        allowed = _maximum(current) if current is not None else None
        if allowed is None or allowed >= need:
            continue
        advice.append(Advice(key, current or "", _wanted(key, need), _buffer_cost(
            key, allowed, widest)))
    return advice


def _wanted(key: str, need: float) -> str:
    """The conf file's value, or one as large as `need` (in MiB) where that is short."""
    wanted = WANTED[key]
    if (_maximum(wanted) or 0) >= need:
        return wanted
    larger = str(math.ceil(need / 2**20) * 2**20)
    parts = wanted.split()
    return " ".join([*parts[:-1], larger])


def _buffer_cost(key: str, allowed: int, link: Link) -> str:
    cap_mbps = allowed * WINDOW_SHARE * 8 / link.rtt_s / 1e6
    return (f"a TCP stream gets at most {allowed / 2**20:.1f} MiB of buffer, so over the "
            f"{link.rtt_s * 1e3:.0f} ms round trip to {link.peer_id} it carries at most about "
            f"{cap_mbps:.0f} Mbit/s; that link measured {link.bits_per_s / 1e6:.0f} Mbit/s "
            f"and needs {2 * link.bdp_bytes / 2**20:.1f} MiB ({key})")


class TuningCheck:
    """The host's advice as the agent's links become known; logs each new finding once."""

    def __init__(self, root: Path = PROC_SYS) -> None:
        self.root = root
        self.links: dict[str, Link] = {}
        self.advice: list[Advice] = []
        self._said: set[str] = set()

    def observe(self, sample: common_pb2.LinkSample, rtt_s: float) -> None:
        """Remember a measured link (a bandwidth figure with its round trip)."""
        if sample.reachable and sample.bandwidth_gbps > 0 and rtt_s > 0:
            self.links[sample.peer_id] = Link(sample.peer_id, rtt_s,
                                              sample.bandwidth_gbps * 1e9)

    def run(self) -> list[Advice]:
        """Check now; log what is new (a setting, or a larger value wanted)."""
        self.advice = check(self.root, self.links.values())
        new = [a for a in self.advice if a.line not in self._said]
        if new:
            self._said.update(a.line for a in new)
            log.warning("this host is not tuned for long links; set\n%s\nto fix it, %s",
                        "\n".join(f"    {a.line}    # now {a.current}: {a.why}" for a in new),
                        HOW)
        return self.advice

    def to_proto(self) -> list[common_pb2.TuningAdvice]:
        return [a.to_proto() for a in self.advice]
