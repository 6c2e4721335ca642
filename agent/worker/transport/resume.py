"""Resuming a direct connection that died with frames on it, instead of failing the epoch
(issue 40).

A direct data-plane connection can die while its frames are in flight without either worker
being gone: a NAT or stateful firewall drops or resets a flow, an agent's front hands over a
second dial of the same pair, a handshake that one end finished and the other did not. Before
this, a connection that had carried a frame was never replaced ("its frames cannot be
replayed"), so a reset during the first frame of a step ended the epoch, and the recovery
placed the same pair on the same path again.

So every direct connection (`TransportConfig.mode` is "dial" or "accept" at both ends)
begins, after the job-key handshake, with each end's `State`: how many of the peer's frames it
has *completed* (read to the end and accounted for), how many it has *sent*, and the first
frame from which it holds a copy of every frame it sent (*replayable*). The sender copies each
frame as it leaves (`Replay`) and drops the copy once the peer acknowledges it: every frame
header carries `ack`, the frames its sender has completed from the receiver
(`dtfm.net.dataplane.Header.ack`), so a pair's traffic the other way acknowledges at no cost
(a pipeline's gradients acknowledge its activations, an all-reduce's halves each other). The
copies are bounded by `TransportConfig.mailbox_bytes` per peer; a frame that does not fit is
sent uncopied, and is lost only if the connection dies before it is read.

Both ends judge the two states with `check`, the same pure function, so they reach the same
verdict without a further message: the pair resumes when, in each direction, the receiver
completed every frame from which the sender can no longer replay. Then each sender resends
what its peer lacks exactly as it first sent it (the same header, ack included, under the same
number: `framemac.Direction.seq`; the same bytes, so no nonce ever seals two messages), and
the receiver drops whatever part of a frame it had read. Otherwise both ends fail the pair
with the same message, naming how many frames were lost. A state that cannot be true (a peer
claiming more frames than were sent to it) is that peer's fault, and said so.

The exchange adds one message each way per connection (16 bytes), sent at once by both ends,
so it costs one one-way delay when a connection is made; each frame costs a copy of its
payload while it is unacknowledged.

A direct path can also fail for good in the middle of an epoch (a firewall rule, a NAT that
no longer maps the dialer's new flows, a route gone). Where the pair has a relay, its two ends
stop trying the direct path after `FALLBACK_S`, each by its own clock, and move the pair to
the relay for the rest of the epoch: both dial it, and the same exchange, framed for the relay
(`Circuit`), resumes the pair there. An end that moved refuses the direct path from then on
(with a reset, which its peer takes for one more failed try), so the two converge on the
relay, never one on each path; each says so in its log. A moved pair is not moved again: a
relay circuit that dies fails the pair, as one planned through the relay does. A relay that
alters a state in transit can only make the pair fail: where frames are sealed
(`dtfm/net/framemac.py`), a frame resent under the wrong number is refused, naming the relay.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

from agent.worker.transport import sockio
from dtfm.net import dataplane as dp

GRACE_S = 20.0  # how long a listener waits for its dialer to resume a connection frames crossed
# where the pair has a relay: how long the ends try the direct path again before both move
# the pair to the relay for the rest of the epoch, and how long each waits there for the other
# (the other end may notice the loss later: a dead path is found in `sockio.UNACKED_S`; within
# the relay's own 60 s for a circuit's partner)
FALLBACK_S = 5.0
RELAY_WAIT_S = 30.0
MEET_S = 5.0  # the relay dialled, both handshakes and the state exchange, on a busy host
# the longest a pair's traffic stops when its direct path dies and it moves: found dead, the
# direct tries, the meeting at the relay. A rank whose wait depends on the pair without being
# one of its ends (a later pipeline stage) cannot see the move, so the worker's shortest wait
# on the dtfm transport is at least this (`agent/worker/deadline.py`)
MEND_S = sockio.UNACKED_S + FALLBACK_S + MEET_S
_MAGIC = b"dtR1"
_STATE = struct.Struct(">4sIII")


class ResumeError(ConnectionError):
    """The peer's state message is not one (a protocol mismatch, or its fault)."""


@dataclass(frozen=True)
class State:
    """One end's account of a pair's frames in this epoch, over all its connections."""

    completed: int  # the peer's frames this end has read to the end
    sent: int  # frames this end has begun to send to the peer
    replayable: int  # the first frame from which this end holds a copy of each one it sent

    def pack(self) -> bytes:
        return _STATE.pack(_MAGIC, self.completed, self.sent, self.replayable)


@dataclass(frozen=True)
class Circuit:
    """A relay circuit's ends (the relay forwards frames only, so there the states travel as
    control frames from `me` to `peer` and back)."""

    job: bytes
    epoch: int
    me: int
    peer: int


def exchange(sock: socket.socket, mine: State, timeout_s: float,
             circuit: Circuit | None = None) -> State:
    """Send `mine` and read the peer's (both ends send first: neither waits on the other)."""
    sock.settimeout(timeout_s)
    if circuit is None:
        sock.sendall(mine.pack())
        raw = dp.recv_exact(sock, _STATE.size)
    else:
        c = circuit
        sock.sendall(dp.control_frame(c.job, c.epoch, c.me, c.peer, dp.RESUME_TAG, mine.pack()))
        raw = dp.read_control(sock, c.job, c.epoch, c.me, c.peer, dp.RESUME_TAG,
                              range(_STATE.size, _STATE.size + 1),
                              f"rank {c.peer}'s first frame through the relay was not its "
                              f"connection state")
    magic, completed, sent, replayable = _STATE.unpack(raw)
    if magic != _MAGIC:
        raise ResumeError(f"the peer's connection state began with {magic!r}, not {_MAGIC!r}: "
                          f"it runs another dtfm (run the same version on every agent)")
    return State(completed, sent, replayable)


def check(me: int, peer: int, mine: State, theirs: State) -> str:
    """Why the pair cannot resume ('' when it can). Both ends compute it from the same two
    states, so both reach the same verdict; `ResumeError` where `theirs` cannot be true."""
    if theirs.completed > mine.sent or theirs.sent < mine.completed or \
            theirs.replayable > theirs.sent:
        raise ResumeError(
            f"rank {peer} claims to have completed {theirs.completed} of the {mine.sent} "
            f"frame(s) rank {me} sent it, and to have sent {theirs.sent} (replayable from "
            f"{theirs.replayable}) where rank {me} completed {mine.completed}: a state no "
            f"honest peer sends; the connection is closed")
    lost = []
    for src, dst, s, r in ((me, peer, mine, theirs), (peer, me, theirs, mine)):
        if r.completed < s.replayable:
            lost.append(f"rank {dst} completed {r.completed} of the {s.sent} frame(s) rank "
                        f"{src} sent, and rank {src} can resend them from frame "
                        f"{s.replayable} only")
    return "; ".join(lost)


class Replay:
    """Copies of the frames a sender sent to one peer that the peer has not acknowledged,
    within `max_bytes`. Changed under the mesh's lock (the sender records, the reader
    releases); `copy` runs outside it, in the sender thread."""

    def __init__(self, enabled: bool, max_bytes: int) -> None:
        self.enabled, self._max = enabled, max_bytes
        self._frames: dict[int, tuple[bytes, bytes]] = {}
        self._held = 0
        self._acked = 0  # frames below this number the peer has read

    def copy(self, header: bytes, payload: memoryview) -> tuple[bytes, bytes] | None:
        """A copy of the frame about to be sent, or None where it would not fit (a racy
        look at the room: `record` decides)."""
        if not self.enabled or self._held + len(payload) > self._max:
            return None
        return header, bytes(payload)

    def record(self, seq: int, frame: tuple[bytes, bytes] | None) -> None:
        if frame is not None and self._held + len(frame[1]) <= self._max:
            self._frames[seq] = frame
            self._held += len(frame[1])

    def release(self, acked: int) -> None:
        """The peer has read every frame below `acked`: their copies go."""
        while self._acked < acked:
            frame = self._frames.pop(self._acked, None)
            if frame is not None:
                self._held -= len(frame[1])
            self._acked += 1

    def replayable(self, sent: int) -> int:
        """The first frame from which every frame up to `sent` is acknowledged or copied."""
        seq = sent
        while seq > self._acked and seq - 1 in self._frames:
            seq -= 1
        return seq

    def since(self, start: int, sent: int) -> list[tuple[bytes, bytes]]:
        """The frames from number `start` up to `sent` (`check` has vouched they are held)."""
        return [self._frames[seq] for seq in range(start, sent)]
