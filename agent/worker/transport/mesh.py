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
epoch as a lost worker does; the error says how to make the pair relayed. Once frames have
crossed, the two ends know the pair worked, so a direct path that then stays broken does move
the pair to its relay, by a rule both ends apply alone (`resume.py`, `connect_relay`).

"Fails" means the peer could not be reached until the deadline, not that one connection
died: a direct connection that dies before its first frame (a listener's agent that parks it
while the worker starts, closes an early hello, or a handshake that one end finished and the
other did not) is dialled again with backoff until `TransportConfig.timeout` (`redial.py`),
and one that dies after frames crossed it is made again and resumed: the two ends exchange
their frame counts and each resends what the other lacks, from copies of its first frames
(`resume.py`), or both fail the pair with the same verdict. The connection's life is
`peer.py`'s.

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
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from agent.worker.transport import redial, resume, sockio, staging
from agent.worker.transport.config import TransportConfig
from agent.worker.transport.peer import Peer, Recv
from agent.worker.transport.work import TransportWork
from dtfm.core.staleentry import StaleEntry
from dtfm.net import dataplane as dp
from dtfm.net import framemac, punch

log = logging.getLogger(__name__)
_RETRY_S = 0.05


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
        self.peers: dict[int, Peer] = {}
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
        moved = (p := self.peers.get(peer)) is not None and p.moved
        relayed = moved or (self.cfg.mode(self.rank, peer) == "relay"
                            and peer not in self.punched)
        relay = (self.cfg.relay_for(self.rank, peer) or "") if relayed else ""
        seq = int(frame.rpartition(" ")[2])
        return framemac.FrameRefused(framemac.refusal_message(framemac.Refusal(
            seq, peer, self.rank, self.cfg.frames, relay)))

    def send(self, dst: int, stream: int, tag: int, tensor: torch.Tensor) -> TransportWork:
        """Send `tensor`'s value now (a GPU or strided one is staged: `staging.outgoing`)."""
        wire = staging.outgoing(tensor)  # a tensor it cannot send fails here, in the caller
        p = self.peer(dst)
        work = TransportWork(self.cfg.timeout, f"send to rank {dst}", [tensor, wire],
                             stalled=p.reconnecting)
        header = dp.Header(self.job, self.cfg.epoch, self.rank, dst, stream, tag,
                           wire.numel() * wire.element_size()
                           + framemac.overhead(self.cfg.frames)).pack()
        p.outbox.put((header, wire, work))
        return work

    def recv(self, src: int, stream: int, tag: int, tensor: torch.Tensor) -> TransportWork:
        """Receive into `tensor` (a GPU or strided one through a host buffer:
        `staging.incoming`, copied into place before the work reports done)."""
        wire, land = staging.incoming(tensor)
        p = self.peer(src)
        work = TransportWork(self.cfg.timeout, f"receive from rank {src}", [tensor], land,
                             stalled=p.reconnecting)
        r = Recv(wire, work, (stream, tag))
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

    def peer(self, rank: int) -> Peer:
        if rank == self.rank or rank not in self.cfg.peers:
            raise ValueError(f"rank {self.rank} has no peer {rank} in its peer table")
        with self.cond:
            if self._closed:  # a peer made now would start a sender that close() never stops
                raise ConnectionError(f"rank {self.rank}'s data plane closed")
            p = self.peers.get(rank)
            if p is None:
                p = self.peers[rank] = Peer(self, rank)
            return p

    def reconnecting(self) -> bool:
        """Whether a connection to any peer is being made again (a collective's work waits
        on several)."""
        return any(p.reconnecting() for p in list(self.peers.values()))

    def spawn(self, target: Callable[[], None], name: str) -> threading.Thread:
        """A transport thread, which `close` stops and joins."""
        t = threading.Thread(target=target, name=name, daemon=True)
        with self.cond:
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()
        return t

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
            for sock in (p.sock, p.exchanging):  # the latter: a resume exchange under way
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
            p.fail(ConnectionError(f"rank {self.rank}'s data plane closed"))
        end = time.monotonic() + join_s
        with self.cond:
            threads = list(self._threads)
        for t in threads:
            if t is not threading.current_thread():
                t.join(max(0.0, end - time.monotonic()))

    # ---- connecting ----
    def connect(self, p: Peer, deadline_s: float | None = None) -> None:
        """Open `p`'s connection (dial or relay) or wait for it to be accepted; a dial tries
        until `deadline_s` (default: the transport's timeout)."""
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
            sock = self._dial(addr, p.rank, role_target, deadline_s)
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

    def connect_relay(self, p: Peer) -> None:
        """Meet `p` at the pair's relay after their direct path failed (`peer.Peer._move`):
        no hole punch (it would open the path that failed), the relay's first frame awaited
        at most `resume.RELAY_WAIT_S` (the peer notices the loss later than this end, or
        never: its worker is gone), then the pair resumed on the circuit."""
        addr = self.cfg.relay_for(self.rank, p.rank)
        assert addr is not None
        sock = self._dial(addr, p.rank, p.rank, resume.RELAY_WAIT_S)
        try:
            punch.partner_address(sock, self.job, self.cfg.epoch, self.rank, p.rank,
                                  resume.RELAY_WAIT_S)
        except OSError as exc:
            sock.close()
            raise ConnectionError(f"rank {p.rank} did not reach the relay at {addr} within "
                                  f"{resume.RELAY_WAIT_S:.0f} s: {exc or type(exc).__name__}"
                                  ) from exc
        p.attach(sock, relayed=True)

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

    def _dial(self, addr: str, peer: int, target: int, deadline_s: float | None = None
              ) -> socket.socket:
        """A connection to `addr` that passed the handshake. A direct one that dies before
        the handshake completes is dialled again until the deadline (`redial.py`; default:
        the transport's timeout)."""
        deadline = self.cfg.timeout.total_seconds() if deadline_s is None else deadline_s
        tries = redial.Attempts(self.rank, peer, addr, deadline)
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
                        f"within {deadline:.0f} s, and each connection died "
                        f"before its first frame; last: {exc or type(exc).__name__}") from exc

    def _connect(self, addr: str, peer: int, target: int,
                 tries: redial.Attempts) -> socket.socket:
        host, port = dp.parse_addr(addr)
        while True:
            try:
                wait = max(0.5, min(10.0, tries.left()))
                return (socket.create_connection((host, port), timeout=wait)
                        if target == dp.NO_RANK else punch.dial_reusable(host, port, wait))
            except OSError as exc:  # not listening yet: it may still be starting
                if tries.left() < 0 or self._closed:
                    what = (f"the relay at {addr} (for its circuit to rank {peer})"
                            if target != dp.NO_RANK else f"rank {peer} at {addr}")
                    raise ConnectionError(f"rank {self.rank} cannot reach {what}: {exc}"
                                          ) from exc
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
