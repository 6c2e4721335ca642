"""Weighing a punched connection against the relay before leaving the relay for it.

A hole punch (punch.py) that gets through gives a pair a direct path, but direct is not
always faster: a relay on a well-connected host (a cloud VM, the coordinator in a data
centre) can beat the direct path between two home connections on another continent.
Taking the direct path blindly then runs slower than the plan predicted: on the emulated
world of `bench/reach.py`, whose relay has free links, the job with hole punching ran at
0.63x the relayed one. Link measurement prices a punched pair by this same rule on its
measured figures (coordinator/links/punchprobe.py `kept`): direct where the direct path
wins, through the relay where the relay does, so what is chosen here is what was planned.

So both ends time the same exchange on both paths before they choose: the lower rank sends
`PROBE_BYTES` and waits for a one-byte answer, on the relay and the direct connection in
turn, `ROUNDS` times (the first round of each also pays for TCP's slow start; the least
time counts), and keeps the direct path unless the relay was faster by more than
`DIRECT_SLACK` (the relay's uplink is shared by every pair it carries, which one pair's
probe sees only in part). It tells the higher rank its choice and both times over the relay
(`CHOSEN_TAG`), so both ends act on one decision and log the same figures. A transfer of a
quarter MiB weighs delay and rate together, as the pair's activations and gradient shards
(tens of KiB to MiBs) do.

What it costs the relay, per pair and epoch: `RELAY_BYTES` of payload (the relay's
forwarded-bytes counter shows it); the time: `ROUNDS` round trips of `PROBE_BYTES` on each
path, well under a second on any path a job would use.
"""

from __future__ import annotations

import math
import socket
import struct
import time
from dataclasses import dataclass

from dtfm.net import dataplane as dp

PROBE_BYTES = 256 * 1024
ROUNDS = 2
DIRECT_SLACK = 1.1  # the direct path is kept unless the relay is faster by more than 10 %
_CHOSEN = struct.Struct(">?dd")  # direct?, the relay's time, the direct path's time
# what weighing one pair forwards through the relay: the probes, their answers, the choice
RELAY_BYTES = ROUNDS * (PROBE_BYTES + 1) + _CHOSEN.size


@dataclass(frozen=True)
class Weighed:
    """Both paths' least round-trip time of `PROBE_BYTES`, and whether the direct is kept."""

    relay_s: float
    direct_s: float
    direct: bool


def choose(relay_s: float, direct_s: float) -> bool:
    """Whether the direct path is kept: not slower than the relay by more than DIRECT_SLACK."""
    return direct_s <= relay_s * DIRECT_SLACK


def _timed(sock: socket.socket, job: bytes, epoch: int, me: int, peer: int) -> float:
    start = time.monotonic()
    sock.sendall(dp.control_frame(job, epoch, me, peer, dp.PROBE_TAG, bytes(PROBE_BYTES)))
    dp.read_control(sock, job, epoch, me, peer, dp.PROBE_TAG, range(1, 2),
                    f"rank {peer} answered a path probe with another frame")
    return time.monotonic() - start


def _answer(sock: socket.socket, job: bytes, epoch: int, me: int, peer: int) -> None:
    dp.read_control(sock, job, epoch, me, peer, dp.PROBE_TAG,
                    range(PROBE_BYTES, PROBE_BYTES + 1),
                    f"rank {peer} sent another frame where a path probe belongs")
    sock.sendall(dp.control_frame(job, epoch, me, peer, dp.PROBE_TAG, b"\x01"))


def weigh(relay: socket.socket, direct: socket.socket, job: bytes, epoch: int, me: int,
          peer: int, timeout_s: float) -> Weighed:
    """Time both paths to `peer` and agree on one (`job` is the job's digest). Both ends call
    it at once; both get the same answer. Raises ConnectionError (or OSError) where a path
    breaks or a frame is not what weighing expects: both ends then see their socket fail."""
    timer = me < peer
    for sock in (relay, direct):
        sock.settimeout(timeout_s)
    times: dict[str, list[float]] = {"relay": [], "direct": []}
    for _ in range(ROUNDS):
        for name, sock in (("relay", relay), ("direct", direct)):
            if timer:
                times[name].append(_timed(sock, job, epoch, me, peer))
            else:
                _answer(sock, job, epoch, me, peer)
    if timer:
        relay_s, direct_s = min(times["relay"]), min(times["direct"])
        chosen = choose(relay_s, direct_s)
        relay.sendall(dp.control_frame(job, epoch, me, peer, dp.CHOSEN_TAG,
                                       _CHOSEN.pack(chosen, relay_s, direct_s)))
        return Weighed(relay_s, direct_s, chosen)
    got = dp.read_control(relay, job, epoch, me, peer, dp.CHOSEN_TAG,
                          range(_CHOSEN.size, _CHOSEN.size + 1),
                          f"rank {peer} ended the path probes with another frame")
    chosen, relay_s, direct_s = _CHOSEN.unpack(got)
    if not (math.isfinite(relay_s) and math.isfinite(direct_s)):
        raise ConnectionError(f"rank {peer} reported path times {relay_s}, {direct_s}: "
                              f"run the same dtfm everywhere")
    return Weighed(relay_s, direct_s, chosen)
