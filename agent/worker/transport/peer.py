"""One peer of a rank's data plane: its connection, the thread that sends to it in order, the
thread that reads its frames, and the receives and mailbox they meet in (`mesh.py` says how
frames are matched, bounded and checked).

The connection's life: made by the end that can (`Side.connect`: dial, relay, punch, or wait
to be dialled), and made again when a direct one dies without either worker being gone. Before
any frame has crossed, the dialer dials again until the receives' deadline (`redial.py`);
after, the two ends exchange their frame counts and resume, resending what the other lacks, or
both fail the pair with one verdict (`resume.py`). The reader alone decides that a connection
died (a failed send shuts it for the reader to see), so one event settles each loss; the old
reader is stopped before a new connection is counted, so no frame is counted twice.
"""

from __future__ import annotations

import functools
import logging
import queue
import socket
import threading
import time
from collections import deque
from typing import Any, Protocol

import torch

from agent.worker.transport import redial, resume, sockio
from agent.worker.transport.config import TransportConfig
from agent.worker.transport.sockio import byte_view
from agent.worker.transport.work import TransportWork
from dtfm.core.staleentry import StaleEntry
from dtfm.net import dataplane as dp
from dtfm.net import framemac

log = logging.getLogger(__name__)
PARKED_POLL_S = 0.25  # how often a reader parked by a full mailbox checks its peer is there
_READER_JOIN_S = 5.0  # how long a new connection waits for the old one's reader to stop
_NO_FRAME = object()  # `Peer._connection`: nothing to count sent


class Side(Protocol):
    """What a peer needs of its rank's data plane (`mesh.Mesh`)."""

    cfg: TransportConfig
    rank: int
    job: bytes
    cond: threading.Condition

    @property
    def closed(self) -> bool: ...

    def spawn(self, target: Any, name: str) -> threading.Thread: ...

    def connect(self, p: Peer, deadline_s: float | None = None) -> None: ...

    def connect_relay(self, p: Peer) -> None: ...

    def refused(self, peer: int, frame: str) -> framemac.FrameRefused: ...

    def direction(self, src: int, dst: int) -> framemac.Direction: ...


class Recv:
    def __init__(self, tensor: torch.Tensor, work: TransportWork, key: tuple[int, int]) -> None:
        self.tensor, self.work, self.key = tensor, work, key


_WAKE = object()  # put in a sender's outbox after a connection is made: resend what is owed


class Peer:
    """The connection to one peer: a sender thread (connects, then sends in order) and a
    reader thread (started once connected)."""

    def __init__(self, mesh: Side, rank: int) -> None:
        self.mesh, self.rank = mesh, rank
        self.sock: socket.socket | None = None
        self.error: BaseException | None = None
        self.connected = threading.Event()
        self.outbox: queue.Queue[Any] = queue.Queue()
        self.posted: dict[tuple[int, int], deque[Recv]] = {}
        self.arrived: dict[tuple[int, int], deque[bytearray]] = {}
        self.unclaimed = 0
        self.sent_bytes = 0  # payload bytes sent; written only by the sender thread
        # frames completed from the peer and begun to it, over every connection this epoch
        self.frames_in = self.frames_out = 0
        # a direct pair's connection can be made again with its frames resent (`resume.py`);
        # a relay circuit or a punched connection is paired by the relay, which a new dial
        # would not find
        self.resumable = mesh.cfg.mode(mesh.rank, rank) in ("dial", "accept")
        # a direct pair whose path failed at run time, moved to the relay for the rest of the
        # epoch (`resume.FALLBACK_S`); from then on this end refuses the direct path
        self.moved = self.relaying = False
        self.replay = resume.Replay(self.resumable, mesh.cfg.mailbox_bytes)
        self.resume_at: int | None = None  # the peer's completed count, for the sender
        self.reader: threading.Thread | None = None
        self.attaching = threading.Lock()  # one new connection at a time
        self.exchanging: socket.socket | None = None  # a new connection's resume exchange
        self.lost_at: float | None = None  # since when the dialer has been connecting again
        self.down = False  # between connections after a loss (either end), until settled
        # this epoch's first connection: until it is made the peer is joining (`joining`)
        self.made_at, self.met = time.monotonic(), False
        self.tries = 0  # its new connections since
        # this pair's frames each way, sealed and checked with its key (framemac.py)
        self.tx, self.rx = mesh.direction(mesh.rank, rank), mesh.direction(rank, mesh.rank)
        mesh.spawn(self._send_loop, f"dtfm-send-{rank}")

    def attach(self, sock: socket.socket, relayed: bool = False) -> None:
        """Use `sock` for this peer and start reading it. A connection already there gives
        way (its reader is stopped first, so nothing more is counted from it); on a direct
        pair the two ends then exchange their frame counts and resume, or fail the pair with
        the same verdict (`resume.check`). Under the mesh's lock at each step, so a mesh closing
        meanwhile either shuts this socket down and joins its reader, or refuses it.
        `relayed`: a relay circuit that a moved pair resumes on (`move`)."""
        with self.attaching:
            with self.mesh.cond:
                if self.mesh.closed or self.error is not None:
                    sock.close()
                    return
                if self.moved and not relayed:
                    self._refuse_direct(sock)
                    return
                old, reader = self.sock, self.reader
                self.sock = None
                self.connected.clear()
                self.mesh.cond.notify_all()
            if old is not None:  # its dialer gave up on it, or saw it die before this end did
                log.warning("rank %d: rank %d connected again (%d frame(s) in, %d out so far): "
                            "the new connection replaces the old one", self.mesh.rank,
                            self.rank, self.frames_in, self.frames_out)
                sockio.abort(old)
            if reader is not None and reader is not threading.current_thread():
                reader.join(_READER_JOIN_S)
                if reader.is_alive():
                    sock.close()
                    self.fail(ConnectionError(
                        f"connection to rank {self.rank} lost: its old reader did not stop "
                        f"within {_READER_JOIN_S} s, so a new connection cannot resume it"))
                    return
            if (self.resumable or relayed) and not self._resume(sock, relayed):
                return
            with self.mesh.cond:
                if self.mesh.closed or self.error is not None:
                    sock.close()
                    return
                if self.moved and not relayed:  # moved while the two ends exchanged
                    self._refuse_direct(sock)
                    return
                if relayed:  # not resumed again: nothing more is copied
                    self.replay.enabled = False
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sockio.keep_alive(sock)
                self.sock, self.lost_at, self.tries, self.down = sock, None, 0, False
                self.met = True
                self.connected.set()
                self.mesh.cond.notify_all()
                self.reader = self.mesh.spawn(self._read_loop, f"dtfm-recv-{self.rank}")
            self.outbox.put(_WAKE)

    def _refuse_direct(self, sock: socket.socket) -> None:
        """Under the mesh's lock: a direct connection after this end moved the pair to the
        relay. A reset, not a FIN: its dialer takes it for one more failed try, and follows
        to the relay within `resume.FALLBACK_S` of its own loss."""
        log.warning("rank %d: rank %d connected directly after this end moved the pair to the "
                    "relay; refused (it follows to the relay)", self.mesh.rank, self.rank)
        sockio.abort(sock)

    def _resume(self, sock: socket.socket, relayed: bool = False) -> bool:
        """Exchange frame counts on a new direct connection (or, `relayed`, the relay circuit
        of a moved pair) and settle what is resent; False (the socket closed, the pair
        waiting, redialling or failed) where it cannot be used."""
        with self.mesh.cond:
            if self.mesh.closed:
                sock.close()
                return False
            mine = resume.State(self.frames_in, self.frames_out,
                                self.replay.replayable(self.frames_out))
            self.exchanging = sock  # a closing mesh shuts it (`Mesh.close`)
        circuit = resume.Circuit(self.mesh.job, self.mesh.cfg.epoch, self.mesh.rank,
                                 self.rank) if relayed else None
        try:
            theirs = resume.exchange(sock, mine, redial.FIRST_HANDSHAKE_S, circuit)
            lost = resume.check(self.mesh.rank, self.rank, mine, theirs)
        except resume.ResumeError as exc:
            sock.close()
            self.fail(exc)
            return False
        except OSError as exc:  # died before its first frame: as a reader would see it
            sockio.abort(sock)
            if relayed:
                self.fail(ConnectionError(f"connection to rank {self.rank} lost: the relay "
                                          f"circuit it moved to failed before the two ends "
                                          f"resumed: {exc}"))
            elif not self.mesh.closed:
                self._again(exc)
            return False
        finally:
            self.exchanging = None
        if lost:
            sock.close()
            self.fail(ConnectionError(f"connection to rank {self.rank} lost and not "
                                      f"resumable: {lost}"))
            return False
        if theirs.completed < mine.sent or mine.completed < theirs.sent or relayed:
            log.warning("rank %d: resumed the connection with rank %d%s: resending %d "
                        "frame(s), rank %d resends %d", self.mesh.rank, self.rank,
                        " through the relay" if relayed else "", mine.sent - theirs.completed,
                        self.rank, theirs.sent - mine.completed)
        with self.mesh.cond:
            self.resume_at = theirs.completed
        return True

    def _detach(self, sock: socket.socket, exc: BaseException, reading: Recv | None) -> bool:
        """`sock` died: forget it (the receive being read, if any, is posted again) and, as
        the dialer, dial again; as the listener wait for it (`resume.GRACE_S`). False where
        the pair cannot be resumed: the caller fails the peer."""
        with self.mesh.cond:
            current = self.sock is sock
            # a peer that closed its end after frames crossed did so on purpose (its worker
            # failed or stopped: a NAT or a lost path resets or times out, it sends no FIN),
            # so its receives fail now, naming it, as they did before connections resumed
            closed = isinstance(exc, dp.PeerClosed) and (self.frames_in or self.frames_out)
            if current and (self.mesh.closed or self.error is not None or not self.resumable
                            or closed):
                return False
            late = self._repost(reading) if reading is not None else None
            if current:
                self.sock = None
                self.connected.clear()
        sockio.abort(sock)
        if late is not None:
            sockio.copy_in(late[0].tensor, late[0].work, late[1], self.rank)
        if current:  # else replaced already: a newer connection carries this peer
            self._again(exc)
        return True

    def reconnecting(self) -> bool:
        """Whether the connection is being made again after a loss (a resume or a move to
        the relay, each bounded), or made for the first time (`joining`): waits on this peer
        sit it out (`work.TransportWork`)."""
        return (self.down and self.error is None and not self.mesh.closed) or self.joining()

    def joining(self) -> bool:
        """Whether this epoch's first connection with the peer is still to be made, within
        the mesh's timeout (the worker's ceiling on any wait). The peer's worker may still be
        starting on a loaded host (importing torch, fetching a checkpoint: a CI run took over
        60 s), which is joining, not freezing: gloo's rendezvous waits it out up to the same
        ceiling, and the dtfm transport has no rendezvous but this. A peer that never comes
        is failed by its dialer's redials, or here once the ceiling has passed."""
        return (not self.met and self.error is None and not self.mesh.closed
                and time.monotonic() - self.made_at < self.mesh.cfg.timeout.total_seconds())

    def _again(self, exc: BaseException) -> None:
        self.down = True
        dialer = self.mesh.cfg.mode(self.mesh.rank, self.rank) == "dial"
        log.warning("rank %d: the connection with rank %d closed (%s) after %d frame(s) in and "
                    "%d out; %s", self.mesh.rank, self.rank, exc or type(exc).__name__,
                    self.frames_in, self.frames_out,
                    "dialling again" if dialer else "waiting for it to dial again")
        if dialer:
            with self.mesh.cond:
                self.lost_at = self.lost_at or time.monotonic()
            self.mesh.spawn(self._redial, f"dtfm-redial-{self.rank}")
        else:
            self.mesh.spawn(functools.partial(self._await_redial, exc), f"dtfm-wait-{self.rank}")

    def _await_redial(self, exc: BaseException) -> None:
        """The listener's bound on a resume: a dialer whose worker is gone never comes back,
        and its receives should say so well before their own deadline. Where the pair has a
        relay, the listener waits `resume.FALLBACK_S` for the direct path, then moves."""
        relay, grace = self._relay(), self._grace()
        with self.mesh.cond:
            if self.mesh.cond.wait_for(lambda: self.sock is not None or self.error is not None
                                       or self.mesh.closed, grace):
                return
            if relay:
                self._move(exc, grace)
        if relay:
            self._to_relay()
            return
        self.fail(ConnectionError(f"connection to rank {self.rank} lost ({exc}), and rank "
                                  f"{self.rank} did not connect again within {grace:.0f} s to "
                                  f"resume it"))

    def _relay(self) -> str | None:
        """The relay this pair would move to (None: none, so a loss is only resumed)."""
        return self.mesh.cfg.relay_for(self.mesh.rank, self.rank)

    def _grace(self) -> float:
        """How long either end tries the direct path after a loss: `resume.FALLBACK_S` before
        moving where the pair has a relay, else `resume.GRACE_S` before failing."""
        return min(resume.FALLBACK_S if self._relay() else resume.GRACE_S,
                   self.mesh.cfg.timeout.total_seconds())

    def _move(self, why: object, waited: float) -> None:
        """Under the mesh's lock: the direct path stays lost; the pair goes to the relay for
        the rest of the epoch (the other end decides the same within `resume.FALLBACK_S` of
        its own loss; `_refuse_direct` makes it so)."""
        self.moved, self.resumable = True, False
        log.warning("rank %d: the direct connection with rank %d was lost (%s) and not made "
                    "again within %.0f s: the pair moves to the relay at %s for the rest of "
                    "epoch %d", self.mesh.rank, self.rank, why, waited,
                    self._relay(), self.mesh.cfg.epoch)

    def _to_relay(self) -> None:
        """Meet the peer at the relay and resume there (once: a second circuit of the pair
        would replace the first at the relay); fail the pair, naming it, if not."""
        with self.mesh.cond:
            if self.relaying:
                return
            self.relaying = True
        try:
            self.mesh.connect_relay(self)
        except BaseException as exc:  # noqa: BLE001 - every waiter must hear why
            self.fail(ConnectionError(
                f"connection to rank {self.rank} lost, and the pair, moved to the relay at "
                f"{self._relay()} after its direct path "
                f"failed, could not resume there: {exc}"))

    def _redial(self) -> None:
        """Connect (the sender thread's first act), or connect again after `_again`: with a
        growing pause between tries, and within `resume.GRACE_S` of the loss once frames
        have crossed (before that, the receives' own deadline bounds it, as a slow start)."""
        relay = self._relay()
        try:
            if self.moved:
                self._to_relay()
                return
            if self.lost_at is None or not (self.frames_in or self.frames_out):
                if self.lost_at is not None:
                    self._pause()
                self.mesh.connect(self)
                return
            grace = self._grace()
            if (left := grace - (time.monotonic() - self.lost_at)) <= 0:
                raise ConnectionError(f"connection to rank {self.rank} lost, and {self.tries} "
                                      f"new connection(s) within {grace:.0f} s did not resume "
                                      f"it")
            self._pause()
            self.mesh.connect(self, max(1.0, left) if relay else None)
        except (dp.AuthError, StaleEntry) as exc:  # a verdict of the peer: no other path
            self.fail(exc)
        except ConnectionError as exc:
            if relay and (self.frames_in or self.frames_out) and not self.mesh.closed:
                with self.mesh.cond:
                    if not self.moved:
                        self._move(exc, resume.FALLBACK_S)
                self._to_relay()
            else:
                self.fail(exc)
        except BaseException as exc:  # noqa: BLE001 - every waiter must hear why
            self.fail(exc)

    def _pause(self) -> None:
        """A growing pause between new connections."""
        time.sleep(min(redial.MAX_BACKOFF_S, redial.FIRST_BACKOFF_S * 2 ** self.tries))
        self.tries += 1

    def _repost(self, r: Recv) -> tuple[Recv, bytearray] | None:
        """Under the mesh's lock: a receive whose frame's connection died mid-read waits for
        the frame again, first in line; or takes it from the mailbox, where a new connection
        already put it (returned for the caller to copy in outside the lock)."""
        got = self.arrived.get(r.key)
        if got:
            buf = got.popleft()
            self.unclaimed -= len(buf)
            return r, buf
        self.posted.setdefault(r.key, deque()).appendleft(r)
        return None

    def _connection(self, stale: socket.socket | None, frame: Any = _NO_FRAME
                    ) -> tuple[socket.socket | None, list[tuple[bytes, bytes]]]:
        """Wait for a connection other than `stale`; with the frames a resume owes the peer,
        to send first. `frame` (its copy, or None where not copied), when given, is counted
        sent on it.
        (None, []) once the peer failed."""
        with self.mesh.cond:
            while self.error is None and (self.sock is None or self.sock is stale):
                self.mesh.cond.wait(PARKED_POLL_S)
            if self.error is not None:
                return None, []
            owed: list[tuple[bytes, bytes]] = []
            if self.resume_at is not None:
                self.tx.seq = self.resume_at  # resent frames keep their numbers
                owed = self.replay.since(self.resume_at, self.frames_out)
                self.resume_at = None
            if frame is not _NO_FRAME:
                self.replay.record(self.frames_out, frame)
                self.frames_out += 1
            return self.sock, owed

    def fail(self, exc: BaseException) -> None:
        with self.mesh.cond:
            if self.error is None:
                self.error = exc
            for q in self.posted.values():
                for r in q:
                    r.work.finish(exc)
            self.posted.clear()
            self.mesh.cond.notify_all()
        self.connected.set()
        if self.sock is not None:
            self.sock.close()

    def _send_loop(self) -> None:
        self._redial()
        while True:
            item = self.outbox.get()
            if item is None:
                return
            if item is _WAKE:
                self._transmit(None)
            else:
                self._transmit(item)

    def _transmit(self, item: tuple[bytes, torch.Tensor, TransportWork] | None) -> None:
        """Send what a resume owes the peer, then `item`. A direct connection that dies
        meanwhile is shut for the reader to notice (it alone detaches, so one verdict settles
        the pair); the next connection's resume then resends the frame where the peer lacks
        it, or the pair fails. Either way the send's work hears the outcome."""
        view, frame, header = None, _NO_FRAME, b""
        if item is not None:
            view = byte_view(item[1])
            # as it leaves, the frame acknowledges what this end has read from the peer
            header = dp.with_ack(item[0], self.frames_in)
            frame = self.replay.copy(header, view)
        sock, owed = self._connection(None, frame)
        while sock is not None:
            try:
                for old_header, payload in owed:
                    self.tx.send(sock, old_header, memoryview(payload))
                if view is not None:
                    self.tx.send(sock, header, view)
                    self.sent_bytes += len(view)
                break
            except ValueError as exc:  # too large to encrypt
                self.fail(ConnectionError(f"sending to rank {self.rank} failed: {exc}"))
            except OSError as exc:
                if not self.resumable:
                    self.fail(ConnectionError(f"sending to rank {self.rank} failed: {exc}"))
                else:
                    sockio.abort(sock)
            view = None  # from here the resume decides whether it is sent again
            sock, owed = self._connection(sock)
        if item is not None:
            item[2].finish(self.error if sock is None else None)

    def _completed(self, sock: socket.socket, reading: Recv) -> bool:
        """A frame read to the end into `reading`: counted, unless `sock` was replaced
        meanwhile (then the receive waits for the frame again: the new connection resends
        it)."""
        with self.mesh.cond:
            if self.sock is sock:
                self.frames_in += 1
                return True
            late = self._repost(reading)
        if late is not None:
            sockio.copy_in(late[0].tensor, late[0].work, late[1], self.rank)
        return False

    def _read_loop(self) -> None:
        """Read frames until the connection ends. Whatever ends it (the peer gone mid-frame, a
        frame it may not send, a bug) fails at once every receive waiting on this peer,
        including the one whose payload was being read, and names the peer: a waiter that
        heard nothing would sit out the group's timeout. The exception: a direct connection
        that can be resumed (`resume.py`), whose receives wait for the new one."""
        sock, reading = self.sock, None
        assert sock is not None
        self.rx.seq = self.frames_in  # a resumed connection starts at the first frame missed
        try:
            while True:
                reading = None
                head = dp.recv_exact(sock, dp.HEADER_BYTES)
                h = dp.Header.unpack(head)
                # the header's tag first: a header a relay changed is its tampering (named),
                # not a peer's wrong frame; from here the header, its length too, is the peer's
                self.rx.receive_head(sock, head)
                h.check(self.mesh.job, self.mesh.cfg.epoch, self.rank, self.mesh.rank)
                reading = self._claim(h, sock)
                if reading is None:  # nothing posted: into the mailbox, whose limit it fits
                    buf = bytearray(self.rx.rest(h.length))
                    dp.recv_into_exact(sock, memoryview(buf))
                    buf = self.rx.open_buffer(head, buf)
                    with self.mesh.cond:
                        if self.sock is not sock:
                            return  # replaced: the new connection resends it
                        self.frames_in += 1
                        late = self._deliver((h.stream, h.tag), buf)
                    if late is not None:
                        sockio.copy_in(late.tensor, late.work, buf, self.rank)
                    continue
                view = byte_view(reading.tensor)
                if len(view) != h.length - self.rx.overhead:  # refused before a byte is held
                    reading.work.finish(RuntimeError(
                        f"rank {self.rank} sent {h.length - self.rx.overhead} bytes (tag "
                        f"{h.tag}) for a receive of {len(view)} bytes: the two ends disagree "
                        f"on the tensor's shape or dtype"))
                    reading = None
                    sockio.discard(sock, self.rx.rest(h.length))
                    self.rx.skip()
                    with self.mesh.cond:
                        if self.sock is not sock:
                            return
                        self.frames_in += 1
                    continue
                self.rx.receive_into(sock, head, view)
                if not self._completed(sock, reading):
                    return
                reading.work.finish()
        except framemac.FrameRefused as exc:  # the pair's key does not vouch for it
            self._lost(reading, self.mesh.refused(self.rank, str(exc)))
        except dp.FrameError as exc:  # a frame it may not send: a verdict, not an accident
            self._lost(reading, ConnectionError(f"connection to rank {self.rank} lost: {exc}"))
        except OSError as exc:
            if self._detach(sock, exc, reading):
                return
            self._lost(reading, ConnectionError(f"connection to rank {self.rank} lost: {exc}"))
        except BaseException as exc:  # noqa: BLE001 - a dead reader must not leave waiters
            log.exception("rank %d: reading from rank %d failed", self.mesh.rank, self.rank)
            self._lost(reading, ConnectionError(
                f"reading from rank {self.rank} failed ({type(exc).__name__}: {exc}); its "
                f"connection is closed"))

    def _claim(self, h: dp.Header, sock: socket.socket) -> Recv | None:
        """The receive posted for frame `h` (taken out of `posted`), or None once the mailbox
        has room for its payload; until then the reader waits (backpressure). A frame larger
        than the whole mailbox waits for its receive: nothing is allocated for a length the
        peer merely claims. A peer that goes meanwhile is noticed (`sockio.gone`), though nothing
        reads its socket: its receives fail then, not at the group's timeout."""
        m, key = self.mesh, (h.stream, h.tag)
        with m.cond:
            if h.ack > self.frames_out:
                raise dp.FrameError(f"rank {self.rank} acknowledged {h.ack} frame(s) of the "
                                    f"{self.frames_out} rank {m.rank} sent it: dropped, "
                                    f"connection closed")
            self.replay.release(h.ack)  # the copies of frames the peer has read go
            while not self.posted.get(key) and self.error is None and \
                    self.unclaimed + h.length > m.cfg.mailbox_bytes:
                if self.sock is not sock:
                    raise ConnectionError("a new connection replaced this one")
                # read on when a receive claims a message or is posted
                if not m.cond.wait(PARKED_POLL_S) and (why := sockio.gone(sock)):
                    raise ConnectionError(f"{why} while its {h.length}-byte message (tag "
                                          f"{h.tag}) waited for a receive")
            if self.error is not None:
                raise ConnectionError(str(self.error))
            return self.posted[key].popleft() if self.posted.get(key) else None

    def _lost(self, reading: Recv | None, err: ConnectionError) -> None:
        """Fail the receive being read (no longer in `posted`) and the rest of this peer's."""
        if reading is not None:
            reading.work.finish(err)
        self.fail(err)

    def _deliver(self, key: tuple[int, int], buf: bytearray) -> Recv | None:
        """Called under the mesh's lock: a message for which no receive was posted. Files it
        in the mailbox, or returns the receive posted while its payload was being read (the
        caller copies it in after releasing the lock)."""
        q = self.posted.get(key)
        if q:
            return q.popleft()
        self.arrived.setdefault(key, deque()).append(buf)
        self.unclaimed += len(buf)
        return None
