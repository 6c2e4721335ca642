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
has *completed* (read to the end and accounted for), how many it has *sent*, and how many of
the first of those it still *keeps*. The sender keeps a copy of its first `REPLAY_FRAMES`
frames to a peer, within `TransportConfig.mailbox_bytes` (`Replay`): the frames of a step's
start, where a freshly made or handed-over connection fails. Frames beyond them are not
copied (a copy of every frame until acknowledged would cost a memory copy per frame and an
acknowledgement stream for a rare event), but a connection that dies *between* frames, with
everything sent also completed, needs no copy.

Both ends judge the two states with `check`, the same pure function, so they reach the same
verdict without a further message: the pair resumes when, in each direction, the receiver
completed everything the sender sent, or every frame it did not complete is kept. Then each
sender resends what its peer lacks, numbered as the first time (`framemac.Direction.seq`: a
frame resealed under its own number is the same bytes), and the receiver drops whatever part
of a frame it had read. Otherwise both ends fail the pair with the same message, naming how
many frames were lost. A state that cannot be true (a peer claiming more frames than were
sent to it) is that peer's fault, and said so.

The exchange adds one message each way per connection (16 bytes), sent at once by both ends,
so it costs one one-way delay when a connection is made and nothing per frame.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

from dtfm.net import dataplane as dp

REPLAY_FRAMES = 8  # the first frames to a peer a sender keeps a copy of, per epoch
GRACE_S = 20.0  # how long a listener waits for its dialer to resume a connection frames crossed
_MAGIC = b"dtR1"
_STATE = struct.Struct(">4sIII")


class ResumeError(ConnectionError):
    """The peer's state message is not one (a protocol mismatch, or its fault)."""


@dataclass(frozen=True)
class State:
    """One end's account of a pair's frames in this epoch, over all its connections."""

    completed: int  # the peer's frames this end has read to the end
    sent: int  # frames this end has begun to send to the peer
    kept: int  # of those, the first `kept` are copied and can be sent again

    def pack(self) -> bytes:
        return _STATE.pack(_MAGIC, self.completed, self.sent, self.kept)


def exchange(sock: socket.socket, mine: State, timeout_s: float) -> State:
    """Send `mine` and read the peer's (both ends send first: neither waits on the other)."""
    sock.settimeout(timeout_s)
    sock.sendall(mine.pack())
    magic, completed, sent, kept = _STATE.unpack(dp.recv_exact(sock, _STATE.size))
    if magic != _MAGIC:
        raise ResumeError(f"the peer's connection state began with {magic!r}, not {_MAGIC!r}: "
                          f"it runs another dtfm (run the same version on every agent)")
    return State(completed, sent, kept)


def check(me: int, peer: int, mine: State, theirs: State) -> str:
    """Why the pair cannot resume ('' when it can). Both ends compute it from the same two
    states, so both reach the same verdict; `ResumeError` where `theirs` cannot be true."""
    if theirs.completed > mine.sent or theirs.sent < mine.completed or \
            theirs.kept > theirs.sent:
        raise ResumeError(
            f"rank {peer} claims to have completed {theirs.completed} of the {mine.sent} "
            f"frame(s) rank {me} sent it, and to have sent {theirs.sent} (keeping "
            f"{theirs.kept}) where rank {me} completed {mine.completed}: a state no honest "
            f"peer sends; the connection is closed")
    lost = []
    for src, dst, s, r in ((me, peer, mine, theirs), (peer, me, theirs, mine)):
        if r.completed < s.sent and s.sent > s.kept:
            lost.append(f"rank {dst} completed {r.completed} of the {s.sent} frame(s) rank "
                        f"{src} sent, and rank {src} kept only its first {s.kept}")
    return "; ".join(lost)


class Replay:
    """The first frames a sender sent to one peer, copied so a new connection can carry them
    again. Used by the peer's sender thread only; `kept` is read under the mesh's lock."""

    def __init__(self, enabled: bool, max_bytes: int, max_frames: int | None = None) -> None:
        self._frames: list[tuple[bytes, bytes]] = []
        self._room = max_bytes
        self._max_frames = REPLAY_FRAMES if max_frames is None else max_frames
        self.open = enabled  # still copying: every frame sent so far is kept

    @property
    def kept(self) -> int:
        return len(self._frames)

    def copy(self, header: bytes, payload: memoryview) -> tuple[bytes, bytes] | None:
        """A copy of the frame about to be sent, while copies still cover every frame sent
        and it fits; None closes the replay (later frames are not copied either)."""
        if not self.open or len(self._frames) >= self._max_frames or len(payload) > self._room:
            self.open = False
            return None
        return header, bytes(payload)

    def record(self, frame: tuple[bytes, bytes] | None) -> None:
        """Under the mesh's lock, as the frame is counted sent."""
        if frame is None or not self.open:
            self.open = False
            return
        self._frames.append(frame)
        self._room -= len(frame[1])

    def since(self, start: int, sent: int) -> list[tuple[bytes, bytes]]:
        """The frames from number `start` up to `sent` (`check` has vouched they are kept)."""
        return self._frames[start:sent]
