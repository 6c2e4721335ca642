"""The dtfm data-plane transport (issue 32): real processes and real sockets on loopback.

- 4 ranks, 2 stages x 2 replicas; ranks 1 and 3 cannot listen (they only dial), so the
  data-parallel pair (1, 3) meets at a relay (`python -m dtfm.relay`, its own process): the
  worker's exact ops give bitwise gloo's results (p2p of any dtype, 2-member all_reduce,
  MIN/MAX, exactly representable 4-member sums); a 4-member sum of random floats equals
  gloo's up to rounding (gloo's ring adds in another order) and is bitwise the same on
  every rank; a large one (reduce-scatter + all-gather) is bitwise the sum in group-rank
  order and each member sends 1.5 tensors of it, not 3.
- A peer without the job's key, or of another job, is dropped by a listener and by the
  relay before any of its bytes reach a receive.
- The relay never pairs ranks of different jobs, and a slow receiver slows the sender while
  the relay holds a bounded number of bytes.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from agent.worker.transport import TransportConfig
from agent.worker.transport.mesh import Mesh
from dtfm.net import dataplane as dp
from dtfm.net.relay import Relay
from dtfm.rpc import free_port
from tests.agent.worker import transport_ranks

SECRET = b"join-token-of-the-test"


def _spawn_ranks(backend: str, cfgs: list[TransportConfig | None], tmp: Path,
                 target: Callable[..., None] = transport_ranks.run) -> list[dict]:
    ctx = mp.get_context("spawn")
    port = free_port()
    outs = [str(tmp / f"{backend}-{r}.pt") for r in range(4)]
    procs = [ctx.Process(target=target, args=(r, backend, port, cfgs[r], outs[r]))
             for r in range(4)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        codes = [p.exitcode for p in procs]
        assert codes == [0, 0, 0, 0], f"{backend} ranks exited with {codes}"
    finally:
        for p in procs:  # always reaped, even when an assertion failed
            if p.is_alive():
                p.kill()
            p.join(5)
    return [torch.load(o) for o in outs]


def _relay_process(tmp: Path) -> tuple[subprocess.Popen, str]:
    secret_file = tmp / "secret"
    secret_file.write_bytes(SECRET)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dtfm.net.relay", "--host", "127.0.0.1",
                             "--port", str(port), "--secret-file", str(secret_file)],
                            stdout=subprocess.PIPE, stderr=(tmp / "relay.log").open("w"),
                            text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "relay listening" in line, line
    return proc, f"127.0.0.1:{port}"


@pytest.mark.timeout(240)
def test_a_direct_pair_of_limited_listeners_talks_directly_the_rest_through_a_relay(
        tmp_path: Path) -> None:
    """Ranks 1 and 3 sit at one site (each reachable from the other only: `limited`, with
    `direct` both ways), rank 2 behind a NAT of its own, rank 0 reachable. The data-parallel
    pair (1, 3) dials directly: the default relay is a dead address, so any attempt of
    theirs to relay would fail; (1, 2) and (2, 3) meet at their pair relay, which forwards
    their bytes. Every op's result is gloo's."""
    relay = Relay(SECRET, pair_timeout_s=60)
    live = relay.start_in_thread()
    dead = f"127.0.0.1:{free_port()}"
    try:
        peers: dict[int, str | None] = {r: f"127.0.0.1:{free_port()}" for r in (0, 1, 3)}
        peers[2] = None
        cfg = TransportConfig("job-a", 1, SECRET, peers, relay=dead,
                              pair_relays={(1, 2): live, (2, 3): live}, limited=frozenset({1, 3}),
                              direct=frozenset({(1, 3), (3, 1)}))
        assert cfg.mode(3, 1) == "dial" and cfg.mode(1, 3) == "accept"  # higher rank dials
        assert cfg.mode(0, 1) == "accept" and cfg.mode(1, 0) == "dial"  # 0 may not dial 1
        assert cfg.mode(2, 1) == cfg.mode(1, 2) == "relay"  # 2 may not dial 1 either
        ours = _spawn_ranks("dtfm", [cfg] * 4, tmp_path)
        assert relay.forwarded("job-a") > 0  # the pairs with rank 2
    finally:
        relay.stop()
    _assert_gloos_results(ours, _spawn_ranks("gloo", [None] * 4, tmp_path))


@pytest.mark.timeout(60)
def test_a_failed_direct_dial_names_the_pair_and_what_to_do() -> None:
    """The coordinator's evidence was wrong (nothing answers at the limited rank's data
    port): the dialler's send fails with an error naming both ranks and the remedy, not a
    bare connection error or a silent switch of path the other end would not follow."""
    cfg = TransportConfig("job-a", 1, SECRET, {0: None, 1: f"127.0.0.1:{free_port()}"},
                          limited=frozenset({1}), direct=frozenset({(0, 1)}),
                          timeout=timedelta(seconds=1))
    assert cfg.mode(0, 1) == "dial"
    m = Mesh(cfg, 0)
    try:
        with pytest.raises(RuntimeError, match=r"rank 0 cannot dial rank 1 directly.*"
                                                  r"--reachable no"):
            m.send(1, 0, 1, torch.zeros(4)).wait(timedelta(seconds=30))
    finally:
        m.close()
    with pytest.raises(ValueError, match="limited rank"):
        TransportConfig("j", 1, SECRET, {0: None, 1: None}, limited=frozenset({1}),
                        direct=frozenset({(0, 1)}))


@pytest.mark.timeout(240)
def test_worker_ops_match_gloo_with_dialers_and_a_relay(tmp_path: Path) -> None:
    relay, relay_addr = _relay_process(tmp_path)
    try:
        peers: dict[int, str | None] = {0: f"127.0.0.1:{free_port()}", 1: None,
                                        2: f"127.0.0.1:{free_port()}", 3: None}
        cfg = TransportConfig("job-a", 1, SECRET, peers, relay=relay_addr)
        assert cfg.mode(1, 3) == cfg.mode(3, 1) == "relay"
        assert cfg.mode(1, 0) == "dial" and cfg.mode(0, 1) == "accept"
        ours = _spawn_ranks("dtfm", [cfg] * 4, tmp_path)
    finally:
        relay.kill()
        relay.wait(10)
    _assert_gloos_results(ours, _spawn_ranks("gloo", [None] * 4, tmp_path))


@pytest.mark.timeout(240)
def test_strided_views_travel_through_host_copies_and_land_in_place(tmp_path: Path) -> None:
    """What a GPU tensor takes (no GPU here): views the mesh cannot read in place are sent
    as a copy of their value when posted, received into a host buffer copied into the view
    (the rest of its base untouched), and all-reduced on a dense copy written back."""
    peers: dict[int, str | None] = {r: f"127.0.0.1:{free_port()}" for r in range(4)}
    cfg = TransportConfig("job-a", 1, SECRET, peers)
    res = _spawn_ranks("dtfm", [cfg] * 4, tmp_path, transport_ranks.run_strided)
    for rank in (1, 3):
        src = rank - 1
        base = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100 * src
        assert torch.equal(res[rank]["into_t"], base.t())  # not the +1000 made after isend
        half = (torch.arange(24, dtype=torch.float32).reshape(4, 6) - src).bfloat16()
        want = torch.zeros(4, 6, dtype=torch.bfloat16)
        want[:, 1:4] = half[:, 1:4]
        assert torch.equal(res[rank]["wide"], want)
    for rank, r in enumerate(res):
        assert torch.equal(r["small"], torch.arange(20.).reshape(4, 5).t() * 10), rank
        assert torch.equal(r["large"], torch.arange(40_000.).reshape(200, 200).t() * 10), rank
        want_cols = torch.ones(8, 8)
        want_cols[:, ::2] = 4
        assert torch.equal(r["cols"], want_cols), rank


def _assert_gloos_results(ours: list[dict], gloo: list[dict]) -> None:
    """The dtfm ranks' results are gloo's: bitwise, but for 4-member sums of random floats
    (another order of addition), which agree across ranks and with the rank-order sum."""
    # the big world SUM: every member reduced in group-rank order, bitwise, and each member
    # sent 2(n-1)/n of the tensor (reduce-scatter + all-gather), not n-1 whole tensors
    ref = ours[0]["world_big_in"].clone()
    for o in ours[1:]:
        ref += o["world_big_in"]
    nbytes = ref.numel() * ref.element_size()
    for rank, o in enumerate(ours):
        assert torch.equal(o["world_big"], ref), f"rank {rank}: world_big not in rank order"
        sent = int(o.pop("dtfm_world_big_sent"))
        assert 0 < sent <= 2 * 3 * nbytes // 4 + 16, (rank, sent, nbytes)
    for rank, (a, b) in enumerate(zip(ours, gloo, strict=True)):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype, (rank, k)
            if k in ("world_rand", "world_big"):  # 4 members: gloo's ring sums in another order
                torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5)
                assert torch.equal(a[k], ours[0][k]), "ranks disagree on the world's sum"
                continue
            assert torch.equal(a[k], b[k]), f"rank {rank}: {k} differs from gloo's"


def _mesh(rank: int, peers: dict[int, str | None], *, secret: bytes = SECRET,
          job: str = "job-a", relay: str | None = None, timeout_s: float = 20) -> Mesh:
    cfg = TransportConfig(job, 1, secret, peers, relay=relay,
                          timeout=timedelta(seconds=timeout_s))
    return Mesh(cfg, rank)


def _intrude(addr: str, secret: bytes, job: str, target: int = dp.NO_RANK) -> None:
    """Dial `addr` as rank 1 with `secret`/`job`, then push a frame whatever it says."""
    host, port = dp.parse_addr(addr)
    with socket.create_connection((host, port), timeout=5) as s:
        hello = dp.new_hello(dp.ROLE_DIAL, job, 1, 1, target)
        s.sendall(hello.pack())
        try:
            theirs = dp.Hello.unpack(dp.recv_exact(s, dp.HELLO_BYTES))
            s.sendall(dp.proof(dp.derive_key(secret, job, 1), hello, theirs))
            payload = torch.full((16,), 666.0)
            s.sendall(dp.Header(dp.job_digest("job-a"), 1, 1, 0, 0, 5, 64).pack())
            s.sendall(payload.numpy().tobytes())
            s.recv(1)  # the listener closes on us
        except (ConnectionError, OSError):
            pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize("secret,job", [(b"not-the-token", "job-a"), (SECRET, "job-b")])
def test_listener_drops_a_peer_without_the_job_key(secret: bytes, job: str) -> None:
    peers = {0: f"127.0.0.1:{free_port()}", 1: None}
    m0 = _mesh(0, peers)
    try:
        buf = torch.zeros(16)
        work = m0.recv(1, 0, 5, buf)
        _intrude(peers[0], secret, job)
        deadline = time.monotonic() + 10
        while m0.rejected == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert m0.rejected == 1
        assert not work.is_completed() and torch.count_nonzero(buf) == 0  # zero bytes in
        m1 = _mesh(1, peers)  # the member that holds the key gets through afterwards
        try:
            m1.send(0, 0, 5, torch.ones(16)).wait()
            work.wait(timedelta(seconds=10))
            assert torch.equal(buf, torch.ones(16))
        finally:
            m1.close()
    finally:
        m0.close()


@pytest.mark.timeout(60)
def test_relay_drops_non_members_and_never_pairs_two_jobs() -> None:
    relay = Relay(SECRET, pair_timeout_s=2)
    addr = relay.start_in_thread()
    try:
        _intrude(addr, b"not-the-token", "job-a", target=0)
        deadline = time.monotonic() + 10
        while relay.rejected == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert relay.rejected == 1
        # rank 0 of job-a and rank 1 of job-b both hold a valid key, each for its own job
        peers: dict[int, str | None] = {0: None, 1: None}
        a = _mesh(0, peers, relay=addr, timeout_s=5)
        b = _mesh(1, peers, relay=addr, job="job-b", timeout_s=5)
        try:
            a.send(1, 0, 7, torch.ones(1000))  # lands in the socket buffer, goes nowhere
            got = torch.zeros(1000)
            recv = b.recv(0, 0, 7, got)
            with pytest.raises(RuntimeError):
                recv.wait(timedelta(seconds=8))
            assert torch.count_nonzero(got) == 0
            assert relay.forwarded_bytes == 0
        finally:
            a.close()
            b.close()
    finally:
        relay.stop()


@pytest.mark.timeout(90)
def test_relay_backpressure_bounds_its_memory() -> None:
    chunk = 64 << 10
    relay = Relay(SECRET, chunk_bytes=chunk)
    addr = relay.start_in_thread()
    peers: dict[int, str | None] = {0: None, 1: None}
    sender = _mesh(0, peers, relay=addr, timeout_s=60)
    total = 32 << 20
    host, port = dp.parse_addr(addr)
    slow = socket.create_connection((host, port), timeout=30)
    try:
        key = dp.derive_key(SECRET, "job-a", 1)
        dp.handshake(slow, key, "job-a", 1, dp.ROLE_DIAL, 1, target=0)
        work = sender.send(1, 0, 9, torch.ones(total // 4))
        time.sleep(1.0)  # the receiver reads nothing for a while
        assert not work.is_completed(), "the sender finished although nobody read"
        assert relay.forwarded_bytes < total // 4
        got = 0
        while got < dp.HEADER_BYTES + total:  # now read, slowly, in small pieces
            data = slow.recv(256 << 10)
            assert data, "the relay closed the circuit"
            got += len(data)
        work.wait(timedelta(seconds=30))
        assert relay.forwarded_bytes == total
        # the write buffer (its high-water mark, a chunk, plus the chunk just written) and
        # the chunk in hand, not the 32 MiB the sender pushed (asyncio's reader buffer adds
        # at most 2 chunks + one socket read)
        assert relay.peak_flow_bytes <= 3 * chunk, relay.peak_flow_bytes
    finally:
        slow.close()
        sender.close()
        relay.stop()


@pytest.mark.timeout(60)
def test_relay_stop_closes_its_circuits() -> None:
    """stop() ends every circuit's task before the loop stops: the members hear the
    connection close at once, not at their timeout, and no task is left pending."""
    relay = Relay(SECRET)
    addr = relay.start_in_thread()
    peers: dict[int, str | None] = {0: None, 1: None}
    a = _mesh(0, peers, relay=addr, timeout_s=30)
    b = _mesh(1, peers, relay=addr, timeout_s=30)
    try:
        got = torch.zeros(4)
        b.recv(0, 0, 1, got)
        a.send(1, 0, 1, torch.ones(4)).wait(timedelta(seconds=20))
        pending = a.recv(1, 0, 2, torch.zeros(4))  # never sent: only a closed circuit ends it
        relay.stop()
        with pytest.raises(RuntimeError, match="lost"):
            pending.wait(timedelta(seconds=10))
    finally:
        a.close()
        b.close()
        relay.stop()


@pytest.mark.timeout(60)
def test_close_stops_and_joins_every_transport_thread() -> None:
    """A worker exits right after its last step: transport threads still reading or copying
    then were stopped mid-torch-call at interpreter exit and the process aborted (exit -6,
    "terminate called without an active exception"). close() leaves none running, even with
    a message in flight that nobody received and a receive nobody answered."""
    peers = {0: f"127.0.0.1:{free_port()}", 1: None}
    m0, m1 = _mesh(0, peers), _mesh(1, peers)
    m1.send(0, 0, 5, torch.ones(1 << 16)).wait()  # lands in 0's mailbox, never claimed
    pending = m1.recv(0, 0, 6, torch.zeros(4))  # 0 never sends it
    m0.close()
    m1.close()
    with pytest.raises(RuntimeError, match="closed|lost"):
        pending.wait(timedelta(seconds=5))
    left = [t.name for t in threading.enumerate() if t.name.startswith("dtfm-")]
    assert left == [], left
