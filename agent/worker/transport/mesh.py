"""One process's authenticated connections to its peers, and tagged messages over them.

A connection per peer, opened on first use by the end that can: a rank that cannot listen
dials one that can; where neither listens both dial the relay, which pairs them
(`dtfm/net/relay.py`), and try to punch a direct connection through their NATs from there
(`punch.py`; `TransportConfig.hole_punch`). A rank reachable from some peers only (its
site's LAN) listens for those the peer table names (`TransportConfig.direct`): they dial it
directly, every other pair with it goes as if it did not listen (`TransportConfig.mode`, the
same rule at both ends).

A direct dial that fails at run time (the coordinator's evidence, a dial of the agent's gRPC
port, did not hold for its data port) is an error naming the pair, not a quiet fall back to
the relay: the listener cannot tell a dialer that gave up from one that has not started yet,
and a relay circuit says nothing until its partner arrives, so a listener that also waited at
the relay could settle on the relay while its dialer's late direct connection was accepted,
or the other way round, and the two ends would disagree on the path. The failure ends the
epoch as a lost worker does; the error says how to make the pair relayed.

"Fails" means the peer could not be reached until the deadline, not that one connection
died: a direct connection that dies before its first frame (a listener's agent that parks it
while the worker starts, closes an early hello, or a handshake that one end finished and the
other did not) is dialled again with backoff until `TransportConfig.timeout`, and the
listener takes the new connection in place of one no frame crossed (`redial.py`). A
connection a frame has crossed is never replaced: its frames cannot be replayed.

Every connection starts with the job-key handshake (`dtfm.net.dataplane.handshake`); a peer
that fails it is closed before any frame is read.

Messages are matched like gloo's: by (source rank, stream, tag), in order. A frame whose
receive is posted is read straight into the receiver's tensor; one that arrives first waits
in a mailbox bounded by `mailbox_bytes` per peer. When the mailbox is full the reader stops
reading that peer until a matching receive is posted, so a fast sender is slowed by TCP's
own flow control rather than growing memory (the worker posts its receives ahead, so this
only bites a peer that runs far ahead). A frame's claimed length is checked before anything
is allocated for it: against its posted receive's tensor, else against the mailbox's room (a
frame larger than the whole mailbox waits for its receive). Any error in a peer's reader
fails every receive waiting on that peer at once, naming it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from agent.worker.transport import redial, sockio, staging
from agent.worker.transport.config import TransportConfig
from agent.worker.transport.sockio import byte_view
from agent.worker.transport.work import TransportWork
from dtfm.core.staleentry import StaleEntry
from dtfm.net import dataplane as dp
from dtfm.net import framemac, punch

log = logging.getLogger(__name__)
_RETRY_S = 0.05
_PARKED_POLL_S = 0.25  # how often a reader parked by a full mailbox checks its peer is there


class _Recv:
    def __init__(self, tensor: torch.Tensor, work: TransportWork) -> None:
        self.tensor, self.work = tensor, work


class _Peer:
    """The connection to one peer: a sender thread (connects, then sends in order) and a
    reader thread (started once connected)."""

    def __init__(self, mesh: Mesh, rank: int) -> None:
        self.mesh, self.rank = mesh, rank
        self.sock: socket.socket | None = None
        self.error: BaseException | None = None
        self.connected = threading.Event()
        self.outbox: queue.Queue[tuple[bytes, torch.Tensor, TransportWork] | None] = queue.Queue()
        self.posted: dict[tuple[int, int], deque[_Recv]] = {}
        self.arrived: dict[tuple[int, int], deque[bytearray]] = {}
        self.unclaimed = 0
        self.sent_bytes = 0  # payload bytes sent; written only by the sender thread
        # whether a frame has begun on the current connection, from the peer and to it
        self.frames_in = self.frames_out = 0
        # this pair's frames each way, sealed and checked with its key (framemac.py)
        self.tx, self.rx = mesh.direction(mesh.rank, rank), mesh.direction(rank, mesh.rank)
        mesh.spawn(self._send_loop, f"dtfm-send-{rank}")

    def attach(self, sock: socket.socket) -> None:
        """Use `sock` for this peer and start reading it; under the mesh's lock, so a mesh
        closing meanwhile either shuts this socket down and joins its reader, or refuses it."""
        with self.mesh.cond:
            old = self.sock
            again = old is not None and not self.replaceable()
            if not again and not self.mesh.closed and self.error is None:
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.sock, self.frames_in, self.frames_out = sock, 0, 0
                self.connected.set()
                self.mesh.spawn(self._read_loop, f"dtfm-recv-{self.rank}")
                if old is not None:  # its reader sees it is no longer current and ends
                    log.warning("rank %d: rank %d connected again before any frame crossed "
                                "its first connection (its dialer gave up on that one): the "
                                "new connection replaces it", self.mesh.rank, self.rank)
                    sockio.shut(old)
                return
        if again:
            log.warning("rank %d: rank %d connected again after frames crossed its first "
                        "connection: the new connection is dropped", self.mesh.rank, self.rank)
        sock.close()

    def replaceable(self) -> bool:
        """Under the mesh's lock: whether the current connection may give way to a new one.
        Only one that no frame has crossed either way and that is direct (a relay circuit or
        a punched connection is paired by the relay, which a new dial would not find)."""
        return (self.frames_in == 0 and self.frames_out == 0 and self.error is None
                and self.mesh.cfg.mode(self.mesh.rank, self.rank) in ("dial", "accept"))

    def _detach(self, sock: socket.socket, exc: BaseException) -> bool:
        """`sock` died before any frame crossed it: forget it and, as its dialer, dial again
        (a listener waits for the redial; its receives keep their own deadline). False
        when the connection is not `replaceable`: the caller fails the peer."""
        with self.mesh.cond:
            if self.sock is not sock:
                return True  # replaced already: a newer connection carries this peer
            if self.mesh.closed or not self.replaceable():
                return False
            self.sock = None
            self.connected.clear()
            dialer = self.mesh.cfg.mode(self.mesh.rank, self.rank) == "dial"
        sock.close()
        log.warning("rank %d: the connection with rank %d closed before its first frame (%s); "
                    "%s", self.mesh.rank, self.rank, exc,
                    "dialling again" if dialer else "waiting for it to dial again")
        if dialer:
            self.mesh.spawn(self._redial, f"dtfm-redial-{self.rank}")
        return True

    def _redial(self) -> None:
        try:
            self.mesh.connect(self)
        except BaseException as exc:  # noqa: BLE001 - every waiter must hear why
            self.fail(exc)

    def _current(self) -> socket.socket | None:
        """The connection to send the next frame on, counted as used; None once failed."""
        while True:
            self.connected.wait()
            with self.mesh.cond:
                if self.error is not None:
                    return None
                if self.sock is not None:
                    self.frames_out += 1
                    return self.sock

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
            header, tensor, work = item
            sock = self._current()
            if sock is None:
                assert self.error is not None
                work.finish(self.error)
                continue
            try:
                view = byte_view(tensor)
                self.tx.send(sock, header, view)
                self.sent_bytes += len(view)
                work.finish()
            except (OSError, ValueError) as exc:  # ValueError: too large to encrypt
                err = ConnectionError(f"sending to rank {self.rank} failed: {exc}")
                work.finish(err)
                self.fail(err)

    def _read_loop(self) -> None:
        """Read frames until the connection ends. Whatever ends it (the peer gone mid-frame, a
        frame it may not send, a bug) fails at once every receive waiting on this peer,
        including the one whose payload was being read, and names the peer: a waiter that
        heard nothing would sit out the group's timeout."""
        sock, reading = self.sock, None
        assert sock is not None
        try:
            while True:
                reading = None
                if self.frames_in:
                    head = dp.recv_exact(sock, dp.HEADER_BYTES)
                else:  # a frame has begun once its first byte is here (`replaceable`)
                    first = dp.recv_exact(sock, 1)
                    with self.mesh.cond:
                        if self.sock is not sock:
                            return  # replaced by a newer connection before its first frame
                        self.frames_in = 1
                    head = first + dp.recv_exact(sock, dp.HEADER_BYTES - 1)
                h = dp.Header.unpack(head)
                # the header's tag first: a header a relay changed is its tampering (named),
                # not a peer's wrong frame; from here the header, its length too, is the peer's
                self.rx.receive_head(sock, head)
                h.check(self.mesh.job, self.mesh.cfg.epoch, self.rank, self.mesh.rank)
                reading = self._claim(h)
                if reading is None:  # nothing posted: into the mailbox, whose limit it fits
                    buf = bytearray(self.rx.rest(h.length))
                    dp.recv_into_exact(sock, memoryview(buf))
                    buf = self.rx.open_buffer(head, buf)
                    with self.mesh.cond:
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
                    continue
                self.rx.receive_into(sock, head, view)
                reading.work.finish()
        except framemac.FrameRefused as exc:  # the pair's key does not vouch for it
            self._lost(reading, self.mesh.refused(self.rank, str(exc)))
        except (OSError, dp.FrameError) as exc:
            if self._detach(sock, exc):
                return
            self._lost(reading, ConnectionError(f"connection to rank {self.rank} lost: {exc}"))
        except BaseException as exc:  # noqa: BLE001 - a dead reader must not leave waiters
            log.exception("rank %d: reading from rank %d failed", self.mesh.rank, self.rank)
            self._lost(reading, ConnectionError(
                f"reading from rank {self.rank} failed ({type(exc).__name__}: {exc}); its "
                f"connection is closed"))

    def _claim(self, h: dp.Header) -> _Recv | None:
        """The receive posted for frame `h` (taken out of `posted`), or None once the mailbox
        has room for its payload; until then the reader waits (backpressure). A frame larger
        than the whole mailbox waits for its receive: nothing is allocated for a length the
        peer merely claims. A peer that goes meanwhile is noticed (`sockio.gone`), though nothing
        reads its socket: its receives fail then, not at the group's timeout."""
        m, key = self.mesh, (h.stream, h.tag)
        with m.cond:
            while not self.posted.get(key) and self.error is None and \
                    self.unclaimed + h.length > m.cfg.mailbox_bytes:
                # read on when a receive claims a message or is posted
                if not m.cond.wait(_PARKED_POLL_S) and self.sock and \
                        (why := sockio.gone(self.sock)):
                    raise ConnectionError(f"{why} while its {h.length}-byte message (tag "
                                          f"{h.tag}) waited for a receive")
            if self.error is not None:
                raise ConnectionError(str(self.error))
            return self.posted[key].popleft() if self.posted.get(key) else None

    def _lost(self, reading: _Recv | None, err: ConnectionError) -> None:
        """Fail the receive being read (no longer in `posted`) and the rest of this peer's."""
        if reading is not None:
            reading.work.finish(err)
        self.fail(err)

    def _deliver(self, key: tuple[int, int], buf: bytearray) -> _Recv | None:
        """Called under the mesh's lock: a message for which no receive was posted. Files it
        in the mailbox, or returns the receive posted while its payload was being read (the
        caller copies it in after releasing the lock)."""
        q = self.posted.get(key)
        if q:
            return q.popleft()
        self.arrived.setdefault(key, deque()).append(buf)
        self.unclaimed += len(buf)
        return None


class Mesh:
    """This rank's data plane: `send` and `recv` of tensors, by peer, stream and tag."""

    def __init__(self, cfg: TransportConfig, rank: int) -> None:
        self.cfg, self.rank = cfg, rank
        self.job = dp.job_digest(cfg.job)
        self.key = dp.derive_key(cfg.secret, cfg.job, cfg.epoch)
        for peer in cfg.peers:  # a missing pair key fails here, naming the pair
            if peer != rank:
                self.direction(rank, peer)
        self.cond = threading.Condition()
        self.peers: dict[int, _Peer] = {}
        self.rejected = 0  # connections that failed the handshake
        self.punched: set[int] = set()  # peers reached by a hole punch, not the relay
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._listener: socket.socket | None = None
        self._handoff: socket.socket | None = None
        addr = cfg.bind or cfg.peers.get(rank)
        if addr is not None and cfg.handoff:
            # the agent accepts on its one public port and passes the sockets over
            self._handoff = dp.connect_handoff(cfg.handoff, cfg.job, cfg.epoch)
            self.spawn(self._handoff_loop, "dtfm-handoff")
            log.info("rank %d: data plane served on the agent's port (%s)", rank, addr)
        elif addr is not None:
            host, port = dp.parse_addr(addr)
            self._listener = socket.create_server((host, port), reuse_port=False)
            self.spawn(self._accept_loop, "dtfm-accept")
            log.info("rank %d: data plane listens on %s", rank, addr)

    # ---- public ----
    @property
    def closed(self) -> bool:
        return self._closed

    def direction(self, src: int, dst: int) -> framemac.Direction:
        """The frames from `src` to `dst` (one end is this rank), with their pair's key."""
        peer = dst if src == self.rank else src
        return framemac.Direction(self.cfg.frames, self.cfg.pair_keys.get(peer, b""), src, dst)

    def refused(self, peer: int, frame: str) -> framemac.FrameRefused:
        """The error of `frame` ("frame N") from `peer` refused: it names the relay the pair
        goes through (the culprit: only the two ends hold the key), or the direct path."""
        relayed = self.cfg.mode(self.rank, peer) == "relay" and peer not in self.punched
        relay = (self.cfg.relay_for(self.rank, peer) or "") if relayed else ""
        seq = int(frame.rpartition(" ")[2])
        return framemac.FrameRefused(framemac.refusal_message(framemac.Refusal(
            seq, peer, self.rank, self.cfg.frames, relay)))

    def send(self, dst: int, stream: int, tag: int, tensor: torch.Tensor) -> TransportWork:
        """Send `tensor`'s value now (a GPU or strided one is staged: `staging.outgoing`)."""
        wire = staging.outgoing(tensor)  # a tensor it cannot send fails here, in the caller
        work = TransportWork(self.cfg.timeout, f"send to rank {dst}", [tensor, wire])
        header = dp.Header(self.job, self.cfg.epoch, self.rank, dst, stream, tag,
                           wire.numel() * wire.element_size()
                           + framemac.overhead(self.cfg.frames)).pack()
        self.peer(dst).outbox.put((header, wire, work))
        return work

    def recv(self, src: int, stream: int, tag: int, tensor: torch.Tensor) -> TransportWork:
        """Receive into `tensor` (a GPU or strided one through a host buffer:
        `staging.incoming`, copied into place before the work reports done)."""
        wire, land = staging.incoming(tensor)
        work = TransportWork(self.cfg.timeout, f"receive from rank {src}", [tensor], land)
        p = self.peer(src)
        r = _Recv(wire, work)
        buf = None
        with self.cond:
            got = p.arrived.get((stream, tag))
            if p.error is not None:
                work.finish(p.error)
            elif got:
                buf = got.popleft()
                p.unclaimed -= len(buf)
                self.cond.notify_all()
            else:
                p.posted.setdefault((stream, tag), deque()).append(r)
                self.cond.notify_all()
        if buf is not None:
            sockio.copy_in(r.tensor, r.work, buf, src)
        return work

    def peer(self, rank: int) -> _Peer:
        if rank == self.rank or rank not in self.cfg.peers:
            raise ValueError(f"rank {self.rank} has no peer {rank} in its peer table")
        with self.cond:
            if self._closed:  # a peer made now would start a sender that close() never stops
                raise ConnectionError(f"rank {self.rank}'s data plane closed")
            p = self.peers.get(rank)
            if p is None:
                p = self.peers[rank] = _Peer(self, rank)
            return p

    def spawn(self, target: Callable[[], None], name: str) -> None:
        """A transport thread, which `close` stops and joins."""
        t = threading.Thread(target=target, name=name, daemon=True)
        with self.cond:
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def close(self, join_s: float = 5.0) -> None:
        """Stop every transport thread and wait for them (at most `join_s`).

        Daemon threads left running at interpreter exit are stopped where they stand when they
        next want the GIL; one inside a torch call then unwinds through C++ frames that do not
        allow it and the process aborts ("terminate called without an active exception",
        exit -6) after training finished. So the world's shutdown and an `atexit` hook
        (backend.register) close the mesh first: sockets shut down (a blocked recv returns),
        senders told to stop, waiters failed, threads joined."""
        with self.cond:  # against peer(): every peer made before this is stopped below
            if self._closed:
                return
            self._closed = True
            peers = list(self.peers.values())
        for lsock in (self._listener, self._handoff):
            if lsock is not None:
                with contextlib.suppress(OSError):
                    lsock.shutdown(socket.SHUT_RDWR)
                lsock.close()
        for p in peers:
            p.outbox.put(None)
            if p.sock is not None:
                with contextlib.suppress(OSError):
                    p.sock.shutdown(socket.SHUT_RDWR)
            p.fail(ConnectionError(f"rank {self.rank}'s data plane closed"))
        end = time.monotonic() + join_s
        with self.cond:
            threads = list(self._threads)
        for t in threads:
            if t is not threading.current_thread():
                t.join(max(0.0, end - time.monotonic()))

    # ---- connecting ----
    def connect(self, p: _Peer) -> None:
        """Open `p`'s connection (dial or relay) or wait for it to be accepted."""
        mode = self.cfg.mode(self.rank, p.rank)
        if mode == "accept":
            if not p.connected.wait(self.cfg.timeout.total_seconds()):
                raise TimeoutError(f"rank {p.rank} did not connect to rank {self.rank} "
                                   f"within {self.cfg.timeout}")
            return
        if mode == "dial":
            addr, role_target = self.cfg.peers[p.rank], dp.NO_RANK
        else:
            addr, role_target = self.cfg.relay_for(self.rank, p.rank), p.rank
        assert addr is not None
        try:
            sock = self._dial(addr, p.rank, role_target)
        except ConnectionError as exc:
            if mode == "dial" and p.rank in self.cfg.limited:
                raise ConnectionError(
                    f"rank {self.rank} cannot dial rank {p.rank} directly at {addr}, though "
                    f"the coordinator found a direct path (rank {p.rank} is reachable from "
                    f"some peers only, and rank {self.rank}'s dial-back or link probe of its "
                    f"gRPC port got through): its data port is not reachable from here. "
                    f"Open it to its site's peers as the gRPC port is (docs/operations.md, "
                    f"Ports), or start that agent with --reachable no so every pair with it "
                    f"is relayed: {exc}") from exc
            raise
        if role_target != dp.NO_RANK:
            sock = self._through_relay(sock, p.rank)
        p.attach(sock)

    def _through_relay(self, sock: socket.socket, peer: int) -> socket.socket:
        """A relay circuit to `peer`, or the direct connection a hole punch opened instead
        (dtfm/net/punch.py)."""
        try:
            observed = punch.partner_address(sock, self.job, self.cfg.epoch, self.rank, peer,
                                             self.cfg.timeout.total_seconds())
            direct = (punch.punch(sock, self.key, self.cfg.job, self.cfg.epoch, self.rank,
                                  peer, observed) if self.cfg.hole_punch else None)
        except BaseException:
            sock.close()
            raise
        if direct is None:
            return sock
        sock.close()
        with self.cond:
            self.punched.add(peer)
        return direct

    def _dial(self, addr: str, peer: int, target: int) -> socket.socket:
        """A connection to `addr` that passed the handshake. A direct one that dies before
        the handshake completes is dialled again until the deadline (`redial.py`)."""
        tries = redial.Attempts(self.rank, peer, addr, self.cfg.timeout.total_seconds())
        while True:
            sock = self._connect(addr, peer, target, tries)
            sock.settimeout(tries.handshake_timeout())
            try:
                theirs = dp.handshake(sock, self.key, self.cfg.job, self.cfg.epoch,
                                      dp.ROLE_DIAL, self.rank, target)
                if target == dp.NO_RANK and theirs.rank != peer:
                    raise StaleEntry(addr, theirs.rank, peer)
                return sock
            except BaseException as exc:
                sock.close()
                if target != dp.NO_RANK or self._closed or not redial.retryable(exc):
                    raise
                if not tries.again(exc):
                    raise ConnectionError(
                        f"rank {self.rank} dialled rank {peer} at {addr} {tries.tries} time(s) "
                        f"until its deadline ({self.cfg.timeout}), and each connection died "
                        f"before its first frame; last: {exc or type(exc).__name__}") from exc

    def _connect(self, addr: str, peer: int, target: int,
                 tries: redial.Attempts) -> socket.socket:
        host, port = dp.parse_addr(addr)
        while True:
            try:
                return (socket.create_connection((host, port), timeout=10)
                        if target == dp.NO_RANK else punch.dial_reusable(host, port, 10))
            except OSError as exc:  # not listening yet: it may still be starting
                if tries.left() < 0 or self._closed:
                    raise ConnectionError(f"rank {self.rank} cannot reach "
                                          f"{'the relay' if target != dp.NO_RANK else 'rank'} "
                                          f"{addr} for rank {peer}: {exc}") from exc
                time.sleep(_RETRY_S)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            self.spawn(functools.partial(self._admit, sock), "dtfm-admit")

    def _handoff_loop(self) -> None:
        """Admit the connections the agent accepted for this epoch, as `_accept_loop` does."""
        assert self._handoff is not None
        while not self._closed:
            try:
                sock = dp.receive_handed(self._handoff)
            except OSError:
                return
            if sock is None:
                if not self._closed:
                    log.warning("rank %d: the agent's data-plane handoff closed: peers can no "
                                "longer dial this rank", self.rank)
                return
            self.spawn(functools.partial(self._admit, sock), "dtfm-admit")

    def _admit(self, sock: socket.socket) -> None:
        sock.settimeout(10)
        try:
            theirs = dp.handshake(sock, self.key, self.cfg.job, self.cfg.epoch,
                                  dp.ROLE_ACCEPT, self.rank)
            if theirs.role != dp.ROLE_DIAL or theirs.rank not in self.cfg.peers or \
                    self.cfg.mode(self.rank, theirs.rank) != "accept":
                raise dp.AuthError(f"rank {theirs.rank} may not dial rank {self.rank}")
        except (OSError, dp.AuthError, ValueError) as exc:
            self.rejected += 1
            log.warning("rank %d: dropped a connection before reading any frame: %s",
                        self.rank, exc)
            sock.close()
            return
        try:
            p = self.peer(theirs.rank)
        except ConnectionError:  # closed while this connection was being admitted
            sock.close()
            return
        p.attach(sock)

    def stats(self) -> dict[str, Any]:
        return {"rejected": self.rejected, "peers": sorted(self.peers),
                "punched": sorted(self.punched),
                "sent_bytes": sum(p.sent_bytes for p in list(self.peers.values()))}
