"""A circuit relay for the data plane: forwards frames between two ranks that cannot dial
each other (both behind NAT), only between authenticated members of the same job and epoch.

Each end dials the relay, proves it holds the job's key (`dtfm.net.dataplane.handshake`,
the relay proves it too) and names the rank it wants to reach. The relay pairs the circuit
(job, epoch, a -> b) with (job, epoch, b -> a) and pumps frames both ways; a circuit whose
partner does not arrive within `pair_timeout_s` is closed. Each frame's header is checked
against the circuit before its payload is read: a frame naming another job, epoch or rank
closes the circuit and nothing of it is forwarded.

Before any frame of theirs, the relay sends each end one control frame
(`dp.OBSERVED_TAG`): the address and port it saw the other end dial from, which behind a NAT
is the NAT's public address and the port it mapped. The ends may use it to open a direct
connection through both NATs (dtfm/net/punch.py) and leave the relay.

Bounded buffers and backpressure: a direction of a circuit holds at most one chunk
(`chunk_bytes`) read from the sender plus the receiver's socket write buffer, which is
capped at `chunk_bytes` too (`set_write_buffer_limits`): when the receiver reads slowly the
relay stops reading from the sender, the sender's socket buffer fills and its sends block.
The reader's buffer pauses at 2 chunks (plus one socket read, 256 KiB in asyncio), so the
relay's memory is bounded by circuits x (~4 chunks + 256 KiB), whatever the senders do
(`Relay.peak_flow_bytes` records the most any direction held in its write buffer and the chunk
in hand, the part the relay itself controls; the tests pin it. The reader's buffer is
asyncio's, bounded by its `limit`, and not counted there).

Keys: the coordinator's relay (`coordinator start --relay-port`) holds one key per running
epoch (`admit`, with the epoch's world size; `retire` drops a job's older epochs), derived
from the fresh per-epoch secret the assignment carries, so a holder of the cluster's join
token who is not a member cannot open a circuit; at most `max_keys` are held (the oldest is
dropped). A relay made with one `secret` (`python -m dtfm.relay --port P --secret-file F`)
derives every job's key from it instead, as before.

Counters (what `coordinator status` and the coordinator's metrics show): `forwarded(job)`,
the payload bytes forwarded for a job (its frames' payloads, not their headers), and
`refused_bytes`, the bytes read from connections the relay then dropped: a handshake that
failed (no key, a non-member's rank, a bad proof) or a frame header that named another job,
epoch or rank. Nothing past such a handshake or header is read, so nothing of it is forwarded.
`stale_dials` counts apart the dials that name a retired epoch of a job the relay serves
(`retire`), or the epoch a restarted coordinator adopted (its key died with the old process):
honest members of an epoch that is ending still move pairs to the relay
(agent/worker/transport/resume.py), and that is no sign of an intruder. They are refused all
the same, after their hello; the claim is not checked (no key is left to check it with), so a
stranger naming such an epoch moves its hello's bytes from one count to the other, no more.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import threading
from dataclasses import dataclass, field

from dtfm.core.assignment import member_address
from dtfm.net import dataplane as dp

MAX_RETIRED = 1024  # jobs whose retired epochs are remembered (the oldest is forgotten)
log = logging.getLogger(__name__)


class StaleEpoch(dp.AuthError):
    """A dial for an epoch this relay retired: refused, but not counted as an intrusion."""


@dataclass
class _Circuit:
    job: bytes
    epoch: int
    src: int
    dst: int
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    partner: asyncio.Future[_Circuit] = field(default_factory=asyncio.Future)


class Relay:
    """The relay server: `await serve()` in a loop, or `start_in_thread()` for tests."""

    def __init__(self, secret: bytes | None = None, host: str = "127.0.0.1", port: int = 0, *,
                 chunk_bytes: int = 1 << 20, pair_timeout_s: float = 60.0,
                 handshake_timeout_s: float = 10.0, max_keys: int = 64) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive: got {chunk_bytes}")
        if secret is not None:
            dp.derive_key(secret, "check", 0)  # an empty secret fails here, with its message
        if max_keys < 1:
            raise ValueError(f"max_keys must be positive: got {max_keys}")
        self.secret, self.host, self.port = secret, host, port
        # (job digest, epoch) -> (key, world size): the epochs admitted, oldest first
        self._keys: dict[tuple[bytes, int], tuple[bytes, int]] = {}
        self._retired: dict[bytes, int] = {}  # job digest -> its epochs before this are retired
        self.max_keys = max_keys
        self._tasks: set[asyncio.Task[None]] = set()
        self.chunk_bytes = chunk_bytes
        self.pair_timeout_s, self.handshake_timeout_s = pair_timeout_s, handshake_timeout_s
        self._waiting: dict[tuple[bytes, int, int, int], _Circuit] = {}
        self.rejected = 0  # connections dropped for failing the handshake
        self.forwarded_bytes = 0  # payload bytes forwarded, every job together
        self._forwarded: dict[bytes, int] = {}  # job digest -> payload bytes forwarded
        self.refused_bytes = 0  # bytes read from connections then dropped (module doc)
        self.stale_dials = 0  # dials for a retired epoch (module doc): refused, not counted
        self.peak_flow_bytes = 0  # the most one direction of one circuit held at once
        self._server: asyncio.base_events.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def admit(self, job: str, epoch: int, secret: bytes, world_size: int) -> None:
        """Forward for ranks 0..world_size-1 of `job`'s `epoch` that prove `secret`'s key.

        Called on the relay's loop (or before it serves): the dict is not locked."""
        if world_size < 1:
            raise ValueError(f"an epoch needs at least one rank: got world_size {world_size}")
        self._keys[(dp.job_digest(job), epoch)] = (dp.derive_key(secret, job, epoch),
                                                   world_size)
        while len(self._keys) > self.max_keys:
            oldest = next(iter(self._keys))
            del self._keys[oldest]
            log.warning("relay: holds at most %d epochs' keys; dropped the oldest (epoch %d)",
                        self.max_keys, oldest[1])

    def retire(self, job: str, before_epoch: int | None = None) -> None:
        """Forget `job`'s keys (of epochs before `before_epoch` only, when given): new
        circuits of those epochs are refused (as stale dials, when `before_epoch` is given:
        the module doc); open ones end with their members."""
        digest = dp.job_digest(job)
        for k in [k for k in self._keys if k[0] == digest
                  and (before_epoch is None or k[1] < before_epoch)]:
            del self._keys[k]
        if before_epoch is not None:
            self._retired[digest] = max(before_epoch, self._retired.pop(digest, 0))
            while len(self._retired) > MAX_RETIRED:
                del self._retired[next(iter(self._retired))]

    def epochs(self) -> list[tuple[bytes, int]]:
        """(job digest, epoch) of every admitted epoch, oldest first."""
        return list(self._keys)

    def forwarded(self, job: str) -> int:
        """Payload bytes forwarded for `job`, every epoch together, since the relay started."""
        return self._forwarded.get(dp.job_digest(job), 0)

    def _key(self, hello: dp.Hello) -> bytes:
        """The key of the epoch a dialler claims (AuthError: not one relayed here)."""
        known = self._keys.get((hello.job, hello.epoch))
        if known is not None:
            key, world = known
            if hello.rank >= world or hello.target >= world or hello.rank == hello.target:
                raise dp.AuthError(f"rank {hello.rank} -> {hello.target} is not a pair of "
                                   f"the epoch's {world} ranks")
            return key
        if self.secret is None:
            if hello.epoch < self._retired.get(hello.job, 0):
                raise StaleEpoch(f"epoch {hello.epoch} of its job is retired here (an epoch "
                                 f"that ended, or one from before a coordinator restart)")
            raise dp.AuthError(f"no job's epoch {hello.epoch} is relayed here (not admitted, "
                               f"or retired)")
        return dp.derive_key(self.secret, hello.job, hello.epoch)

    def outgoing(self, header: dp.Header, chunk: bytes) -> bytes:
        """What the relay forwards of `chunk`, a piece of the body of a frame with `header`:
        the chunk itself. The one place a relay touches what it forwards; the tests' hostile
        relay overrides it (the ends refuse what it changes: dtfm/net/framemac.py)."""
        return chunk

    async def serve(self) -> None:
        self._server = await asyncio.start_server(self._on_connect, self.host, self.port,
                                                  limit=self.chunk_bytes)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("relay listens on %s:%d", self.host, self.port)

    def accept(self, sock: socket.socket, hello: dp.Hello | None = None) -> None:
        """Serve a connection another listener accepted (dtfm/net/front.py: the relay on the
        daemon's one public port), on the running loop, exactly as if `serve` had: the
        hello is still unread in `sock` (`hello`, peeked by the front, is not used)."""
        task = asyncio.get_running_loop().create_task(self._accepted(sock))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accepted(self, sock: socket.socket) -> None:
        try:
            reader, writer = await asyncio.open_connection(sock=sock, limit=self.chunk_bytes)
        except OSError as exc:
            sock.close()
            log.warning("relay: a connection handed over was lost: %s", exc)
            return
        await self._on_connect(reader, writer)

    def start_in_thread(self) -> str:
        """Serve on a daemon thread's own loop; the 'host:port' it listens on."""
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(self.serve())
            ready.set()
            try:
                self._loop.run_forever()
            finally:
                self._loop.close()

        self._thread = threading.Thread(target=run, name="dtfm-relay", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the relay did not start listening within 10 s")
        return f"{self.host}:{self.port}"

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop a `start_in_thread()` relay: close the listener and every circuit, let each
        connection's task finish on the loop, then stop and close the loop (a loop stopped
        with tasks still pending leaves them to be destroyed later, with warnings)."""
        if self._loop is None or self._thread is None or not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self.aclose(), self._loop).result(timeout_s)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)

    async def aclose(self) -> None:
        """Close the listener and every circuit; returns when their tasks have finished."""
        if self._server is not None:
            self._server.close()
        tasks = list(self._tasks)  # its own connections' only: it may share the loop
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0)  # the closed transports' connection_lost callbacks run

    async def _on_connect(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        read = [0]  # bytes the handshake read, refused if it fails
        try:  # closed however this ends, a cancellation by aclose() included
            try:
                circuit = await asyncio.wait_for(self._handshake(reader, writer, read),
                                                 self.handshake_timeout_s)
            except StaleEpoch as exc:
                self.stale_dials += 1
                log.info("relay: refused %s: %s", peer, exc)
                return
            except (dp.AuthError, ConnectionError, asyncio.IncompleteReadError,
                    TimeoutError) as exc:
                self.rejected += 1
                self.refused_bytes += read[0]
                log.warning("relay: dropped %s before reading any frame: %s", peer, exc)
                return
            await self._pair_and_pump(circuit)
        finally:
            writer.close()

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         read: list[int]) -> _Circuit:
        """The circuit a dialler proves; `read[0]` counts the bytes read from it."""
        theirs = dp.Hello.unpack(await _read(reader, dp.HELLO_BYTES, read))
        if theirs.role != dp.ROLE_DIAL or theirs.target == dp.NO_RANK:
            raise dp.AuthError("a relay circuit must name the rank it wants to reach")
        key = self._key(theirs)
        mine = dp.Hello(dp.ROLE_RELAY, theirs.job, theirs.epoch, dp.NO_RANK, theirs.target,
                        dp.new_hello(dp.ROLE_RELAY, "", 0, 0).nonce)
        writer.write(mine.pack())
        writer.write(dp.proof(key, mine, theirs))
        dp.check_proof(key, theirs, mine, await _read(reader, dp.PROOF_BYTES, read))
        writer.transport.set_write_buffer_limits(high=self.chunk_bytes)
        return _Circuit(theirs.job, theirs.epoch, theirs.rank, theirs.target, reader, writer)

    async def _pair_and_pump(self, c: _Circuit) -> None:
        me, other = (c.job, c.epoch, c.src, c.dst), (c.job, c.epoch, c.dst, c.src)
        if other in self._waiting:
            partner = self._waiting.pop(other)
            for end, seen in ((c, partner), (partner, c)):  # before either pump runs
                end.writer.write(dp.control_frame(
                    c.job, c.epoch, seen.src, end.src, dp.OBSERVED_TAG,
                    member_address(*seen.writer.get_extra_info("peername")[:2]).encode()))
            partner.partner.set_result(c)
            log.info("relay: circuit between ranks %d and %d of epoch %d open", c.dst, c.src,
                     c.epoch)
        else:
            if me in self._waiting:
                log.warning("relay: rank %d of epoch %d dialled again for rank %d: the "
                            "older circuit is replaced", c.src, c.epoch, c.dst)
                self._waiting.pop(me).partner.cancel()
            self._waiting[me] = c
            try:
                partner = await asyncio.wait_for(asyncio.shield(c.partner),
                                                 self.pair_timeout_s)
            except (TimeoutError, asyncio.CancelledError):
                if self._waiting.get(me) is c:
                    del self._waiting[me]
                log.warning("relay: rank %d's circuit to rank %d (epoch %d) found no "
                            "partner within %.0f s", c.src, c.dst, c.epoch, self.pair_timeout_s)
                return
        # each side's task pumps its own direction; the pair ends when either does
        try:
            await self._pump(c, partner)
        finally:
            partner.writer.close()

    async def _pump(self, src: _Circuit, dst: _Circuit) -> None:
        """Forward frames src -> dst: header checked, payload in bounded chunks."""
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                raw = await src.reader.readexactly(dp.HEADER_BYTES)
                header = dp.Header.unpack(raw)
                try:
                    header.check(src.job, src.epoch, src.src, src.dst)
                except dp.FrameError as exc:
                    self.refused_bytes += len(raw)
                    log.warning("relay: %s", exc)
                    return
                dst.writer.write(raw)
                left = header.length
                while left:
                    chunk = await src.reader.readexactly(min(left, self.chunk_bytes))
                    left -= len(chunk)
                    self._forwarded[src.job] = self._forwarded.get(src.job, 0) + len(chunk)
                    self.forwarded_bytes += len(chunk)  # before the write: a reader may
                    dst.writer.write(self.outgoing(header, chunk))  # see the bytes first
                    # what this relay holds for the direction beyond asyncio's reader
                    # buffer (bounded by the reader's limit, 2 chunks + one socket read)
                    held = dst.writer.transport.get_write_buffer_size() + len(chunk)
                    self.peak_flow_bytes = max(self.peak_flow_bytes, held)
                    await dst.writer.drain()


async def _read(reader: asyncio.StreamReader, n: int, read: list[int]) -> bytes:
    """`n` bytes, counted in `read[0]` (a short read too, before it raises)."""
    try:
        data = await reader.readexactly(n)
    except asyncio.IncompleteReadError as exc:
        read[0] += len(exc.partial)
        raise
    read[0] += n
    return data


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m dtfm.relay", description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="0.0.0.0", help="address to listen on")
    ap.add_argument("--port", type=int, required=True, help="port to listen on")
    ap.add_argument("--secret-file", required=True,
                    help="file holding the job's secret (the join token)")
    ap.add_argument("--chunk-bytes", type=int, default=1 << 20,
                    help="bytes a circuit direction holds at most per chunk")
    args = ap.parse_args(argv)
    try:
        with open(args.secret_file, "rb") as f:
            secret = f.read().strip()
    except OSError as exc:
        raise SystemExit(f"cannot read --secret-file {args.secret_file}: {exc.strerror}") from exc
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    relay = Relay(secret, args.host, args.port, chunk_bytes=args.chunk_bytes)

    async def run() -> None:
        await relay.serve()
        print(f"relay listening on {relay.host}:{relay.port}", flush=True)
        await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


if __name__ == "__main__":
    main()
