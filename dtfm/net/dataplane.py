"""The data plane's wire: frames, the job key and the handshake (no torch, no grpc).

Shared by the worker's transport (`agent/worker/transport/`) and the relay (`dtfm/net/relay.py`),
so both speak exactly one format. Everything here is pure or works on a blocking socket; the
relay reuses the pure parts from asyncio.

Authentication: every connection starts with a handshake in which each side proves it holds
the job's key by an HMAC over a fresh nonce chosen by the *other* side (so a recorded proof
cannot be replayed) and over its own claimed rank and role (so a proof cannot be reflected
back). The key is derived from the job's secret (the join token, or a per-job secret the
coordinator hands out) and the job and epoch ids: it never crosses the wire, and a key of one
job or epoch proves nothing in another. Nothing after the handshake is read from a peer that
failed it: the caller closes the socket.

Frames: a fixed header (job digest, epoch, source and destination rank, stream, tag, payload
length) then the payload. The receiver checks the header against what the handshake
established (its job, epoch, the peer's rank, its own rank) before it reads the payload.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from collections.abc import Container
from dataclasses import dataclass

MAGIC = b"DTFP"
VERSION = 2  # 2: frame headers carry `ack`, and direct connections resume
NONCE_BYTES = 32
PROOF_BYTES = 32
NO_RANK = 0xFFFFFFFF  # "no target": a direct connection names no relay target

# magic, version, role, job digest, epoch, rank, target rank, nonce
_HELLO = struct.Struct(f"!4sBB16sII I{NONCE_BYTES}s")
# job digest, epoch, src, dst, stream, tag, payload length, frames acknowledged
_HEADER = struct.Struct("!16sIIIQqQI")
HELLO_BYTES = _HELLO.size
HEADER_BYTES = _HEADER.size
_ACK = struct.Struct("!I")  # the header's last field

ROLE_DIAL = 1
ROLE_ACCEPT = 2
ROLE_RELAY = 3

# Control frames on a relay circuit, before any tensor (dtfm/net/punch.py): the
# relay tells each end the address it saw the other end dial from (OBSERVED, sent by the
# relay as from the partner's rank), and each end tells the other whether its hole punch
# got through (PUNCHED, one byte); where both did, they time both paths (PROBE) and the lower
# rank says which one they keep (CHOSEN; dtfm/net/pathweigh.py). A stream id no
# group hashes to (`stream_id` is a hash).
CONTROL_STREAM = 0xFFFF_FFFF_FFFF_FFFE
OBSERVED_TAG = 1
PUNCHED_TAG = 2
PROBE_TAG = 3
CHOSEN_TAG = 4
RESUME_TAG = 5  # a resume's state on a relay circuit (agent/worker/transport/resume.py)
# On the direct connection a punch probe at link measurement opened (agent/probing/punchprobe.py),
# never through a relay: round trips (PING), a timed bulk transfer in frames (BULK; an empty
# one ends it), the receiver's "rate settled, stop" (STOP) and the rate it measured (RATE).
PING_TAG = 5
BULK_TAG = 6
STOP_TAG = 7
RATE_TAG = 8


class AuthError(ConnectionError):
    """The peer did not prove it holds the job's key, or spoke something else."""


class FrameError(ConnectionError):
    """A frame that does not belong on this connection (wrong job, epoch or ranks)."""


def job_digest(job: str) -> bytes:
    """16 bytes naming a job on the wire (job ids are free-form strings)."""
    return hashlib.sha256(job.encode()).digest()[:16]


def derive_key(secret: bytes, job: str | bytes, epoch: int) -> bytes:
    """The key of one job's epoch: HMAC(secret, label | job digest | epoch); never sent.

    `job` is the job id or its digest (a relay knows only the digest its peers send)."""
    if not secret:
        raise ValueError("the data plane needs the job's secret (the join token): got none")
    digest = job if isinstance(job, bytes) else job_digest(job)
    return hmac.new(secret, b"dtfm-dataplane-v1\0" + digest + struct.pack("!I", epoch),
                    hashlib.sha256).digest()


@dataclass(frozen=True)
class Hello:
    """The first message each side sends: who it claims to be and a fresh nonce."""

    role: int
    job: bytes  # job_digest
    epoch: int
    rank: int
    target: int  # the rank a relay should connect this circuit to; NO_RANK otherwise
    nonce: bytes

    def pack(self) -> bytes:
        return _HELLO.pack(MAGIC, VERSION, self.role, self.job, self.epoch, self.rank,
                           self.target, self.nonce)

    @staticmethod
    def unpack(data: bytes) -> Hello:
        magic, version, role, job, epoch, rank, target, nonce = _HELLO.unpack(data)
        if magic != MAGIC or version != VERSION:
            raise AuthError(f"not a dtfm data-plane peer (magic {magic!r}, version {version})")
        return Hello(role, job, epoch, rank, target, nonce)


def new_hello(role: int, job: str, epoch: int, rank: int, target: int = NO_RANK) -> Hello:
    return Hello(role, job_digest(job), epoch, rank, target, os.urandom(NONCE_BYTES))


def proof(key: bytes, mine: Hello, theirs: Hello) -> bytes:
    """What `mine`'s sender sends to prove it holds `key`: bound to both hellos, so to the
    other side's fresh nonce, and to the sender's role, rank and target."""
    return hmac.new(key, b"dtfm-proof\0" + mine.pack() + theirs.pack(), hashlib.sha256).digest()


def check_proof(key: bytes, theirs: Hello, mine: Hello, got: bytes) -> None:
    if not hmac.compare_digest(proof(key, theirs, mine), got):
        raise AuthError(f"peer claiming rank {theirs.rank} failed the handshake: it does not "
                        f"hold this job's key (wrong token, job or epoch)")


def check_hello(theirs: Hello, job: str, epoch: int) -> None:
    if theirs.job != job_digest(job) or theirs.epoch != epoch:
        raise AuthError(f"peer claiming rank {theirs.rank} is in another job or epoch "
                        f"(epoch {theirs.epoch}; this is {job!r} epoch {epoch})")


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return bytes(buf)


class PeerClosed(ConnectionError):
    """The peer closed its end (a FIN: its process closed the socket or exited), as opposed
    to a reset or a timeout, which a NAT, a firewall or a lost path also cause."""


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if k == 0:
            raise PeerClosed("peer closed the connection mid-message")
        got += k


def handshake(sock: socket.socket, key: bytes, job: str, epoch: int, role: int, rank: int,
              target: int = NO_RANK) -> Hello:
    """Run the handshake on a connected blocking socket; the peer's verified hello.

    Both sides send a hello, then a proof over both hellos. The caller sets a timeout on
    `sock` first; AuthError (close the socket, read nothing more) when the peer fails.
    """
    mine = new_hello(role, job, epoch, rank, target)
    sock.sendall(mine.pack())
    theirs = Hello.unpack(recv_exact(sock, HELLO_BYTES))
    check_hello(theirs, job, epoch)
    sock.sendall(proof(key, mine, theirs))
    check_proof(key, theirs, mine, recv_exact(sock, PROOF_BYTES))
    return theirs


@dataclass(frozen=True)
class Header:
    """One frame's header: `length` payload bytes follow it."""

    job: bytes
    epoch: int
    src: int
    dst: int
    stream: int  # which group (and whether a collective) the message belongs to
    tag: int
    length: int
    # how many of the receiver's frames to the sender the sender has read to the end (a
    # resumable connection's acknowledgement: agent/worker/transport/resume.py)
    ack: int = 0

    def pack(self) -> bytes:
        return _HEADER.pack(self.job, self.epoch, self.src, self.dst, self.stream, self.tag,
                            self.length, self.ack)

    @staticmethod
    def unpack(data: bytes) -> Header:
        return Header(*_HEADER.unpack(data))

    def check(self, job: bytes, epoch: int, src: int, dst: int) -> None:
        """Raise FrameError unless this frame travels from `src` to `dst` in job/epoch."""
        if (self.job, self.epoch, self.src, self.dst) != (job, epoch, src, dst):
            raise FrameError(f"frame from rank {self.src} to rank {self.dst} (epoch "
                             f"{self.epoch}) on the connection from rank {src} to rank {dst} "
                             f"(epoch {epoch}) or of another job: dropped, connection closed")


def with_ack(header: bytes, ack: int) -> bytes:
    """`header` (packed) with its `ack` set: stamped by the sender as the frame leaves."""
    return header[:-_ACK.size] + _ACK.pack(ack)


def control_frame(job: bytes, epoch: int, src: int, dst: int, tag: int,
                  payload: bytes) -> bytes:
    """A control frame (`CONTROL_STREAM`) from `src` to `dst`: its header, then `payload`."""
    return Header(job, epoch, src, dst, CONTROL_STREAM, tag, len(payload)).pack() + payload


def read_control(sock: socket.socket, job: bytes, epoch: int, me: int, peer: int, tag: int,
                 lengths: range, mismatch: str) -> bytes:
    """The payload of the next frame on `sock`, which must be a control frame from `peer` to
    `me` with `tag` and a length in `lengths`; ConnectionError naming `mismatch` else (a
    FrameError where the frame is of another job, epoch or pair)."""
    h = Header.unpack(recv_exact(sock, HEADER_BYTES))
    h.check(job, epoch, peer, me)
    if (h.stream, h.tag) != (CONTROL_STREAM, tag) or h.length not in lengths:
        raise ConnectionError(f"{mismatch} (stream {h.stream:#x}, tag {h.tag}, "
                              f"{h.length} bytes): run the same dtfm everywhere")
    return recv_exact(sock, h.length)


def stream_id(group: str, collective: bool) -> int:
    """A 64-bit stream id for a group's point-to-point or collective messages."""
    h = int.from_bytes(hashlib.sha256(group.encode()).digest()[:8], "big") & ~1
    return h | int(collective)


def may_dial(a: int, b: int, listening: Container[int], limited: Container[int],
             direct: Container[tuple[int, int]]) -> bool:
    """Whether rank `a` may dial rank `b` by the peer table: `b` listens, for everyone or, a
    `limited` rank (reachable from some peers only), for the (dialer, listener) pairs in
    `direct`. One rule for the coordinator that writes the table and the workers that read
    it (`TransportConfig.mode`), so both ends of a pair and the relay plan agree."""
    return b in listening and (b not in limited or (a, b) in direct)


# Handing accepted connections to the worker (dtfm/net/handoff.py): where an agent serves
# the data plane on its one public port, its front accepts the connection and passes the
# socket itself (SCM_RIGHTS, no copy) to the epoch's worker over an abstract Unix socket
# whose name the worker finds in this variable. The worker claims its (job, epoch) first.
HANDOFF_ENV = "DTFM_DATA_HANDOFF"
_CLAIM = struct.Struct("!16sI")
CLAIM_BYTES = _CLAIM.size


def claim(job: str, epoch: int) -> bytes:
    """What a worker sends when it connects to the handoff: the epoch it takes peers for."""
    return _CLAIM.pack(job_digest(job), epoch)


def unpack_claim(data: bytes) -> tuple[bytes, int]:
    """(job digest, epoch) of a worker's claim."""
    job, epoch = _CLAIM.unpack(data)
    return job, epoch


def connect_handoff(name: str, job: str, epoch: int) -> socket.socket:
    """A worker's connection to its agent's handoff `name`, claiming (job, epoch)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect("\0" + name)
        sock.sendall(claim(job, epoch))
    except OSError as exc:
        sock.close()
        raise ConnectionError(f"cannot reach the agent's data-plane handoff {name!r} "
                              f"({HANDOFF_ENV}): {exc}; is the agent running?") from exc
    return sock


def receive_handed(sock: socket.socket) -> socket.socket | None:
    """The next connection the agent hands over on `sock`; None once the agent is gone."""
    _, fds, _, _ = socket.recv_fds(sock, 1, 1)
    if not fds:
        return None
    return socket.socket(fileno=fds[0])


def parse_addr(addr: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port), with an error that says what was wrong."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {addr!r} is not HOST:PORT")
    return host.strip("[]"), int(port)
