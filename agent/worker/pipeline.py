"""Pipeline schedules (GPipe and 1F1B) over torch.distributed point-to-point messages.

Owns the order in which a stage runs its micro-batches' forward and backward passes and the
activation/gradient traffic with its neighbours. Activations and gradients are kept apart so
traffic in one direction never waits for a message of the other kind:

- gloo: every message travels over the pipeline's group (see `world.py`), tagged `TAG_ACT`
  or `TAG_GRAD`; gloo matches point-to-point messages by (peer, tag), so no per-link group
  (and none of the round trips that creating one costs over a WAN) is needed.
- NCCL: one communicator serialises its operations on one stream, so each direction of each
  link gets its own two-rank group (that is what keeps 1F1B's opposite-direction sends free
  of deadlock); NCCL connects a group only on first use, so creating them costs nothing.

Messages may travel compressed (`compress.py`): each link has a codec, the same for the
activations it carries forward and the gradients it carries back (`codec_prev`, `codec_next`:
`Assignment.pp_compress_prev/next`, chosen per link by the coordinator). A compressed message
is a `uint8` buffer of a size both ends know. Validation passes always send exact
activations, so the validation loss measures the trained model, not the codec.

All of a step's receives are posted when it starts (`irecv`; gloo only sends once the
receiver has said it is ready, so a late receive costs one more one-way delay per hop) and
sends are asynchronous (`isend`), so receive, compute and send overlap as far as the backend
allows. The receive buffers are the stage's inputs, a small part of its activations.

Both schedules run backward passes in micro-batch order 0..M-1, so they accumulate the same
gradients in the same order and give bit-identical results; they differ only in when the
backward passes happen (GPipe: after all forwards; 1F1B: interleaved, which bounds stored
activations at S - stage micro-batches instead of M).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from agent.worker.compress import TensorCodec
from agent.worker.deadline import DEFAULT_CEILING_S, Deadline
from agent.worker.errors import wait_all
from agent.worker.linkstats import LinkTally
from agent.worker.stage import Stage, lm_loss
from dtfm.core.layout import delayed_step_ops, pipeline_ops

TAG_ACT = 1  # activations, stage s -> s+1
TAG_GRAD = 2  # gradients of activations, stage s+1 -> s


@dataclass
class Links:
    """This rank's pipeline neighbours and the groups to reach them."""

    prev: int | None = None
    next: int | None = None
    fwd_from_prev: dist.ProcessGroup | None = None  # activations in
    bwd_to_prev: dist.ProcessGroup | None = None  # gradients out
    fwd_to_next: dist.ProcessGroup | None = None  # activations out
    bwd_from_next: dist.ProcessGroup | None = None  # gradients in


def make_links(
    pipelines: list[list[int]], rank: int, backend: str = "gloo",
    pipe_group: dist.ProcessGroup | None = None, timeout: timedelta | None = None,
) -> Links:
    """This rank's links in its pipeline (`pipelines`: every replica's ranks by stage).

    gloo: every link uses this rank's `pipe_group` (tags keep the directions apart); nothing
    is created. NCCL: two groups per link of every pipeline, created by every rank in the
    same order without `use_local_synchronization`. (In torch 2.13 a member-only group is
    named by a hash of its ranks *and the number of groups the calling process created
    before*, so two ranks that created different numbers of links before a shared one would
    pick different names and wait for each other forever; with the world's shared counter
    the names agree. NCCL creates its communicators on first use, so a group costs no round
    trip here, and non-members return at once.)
    """
    pipeline = next(p for p in pipelines if rank in p)
    i = pipeline.index(rank)
    links = Links(
        prev=pipeline[i - 1] if i > 0 else None,
        next=pipeline[i + 1] if i + 1 < len(pipeline) else None,
    )
    if backend != "nccl":
        g = pipe_group
        links.fwd_from_prev = links.bwd_to_prev = links.fwd_to_next = links.bwd_from_next = g
        return links
    for ranks in pipelines:
        for a, b in zip(ranks, ranks[1:], strict=False):
            fwd = dist.new_group([a, b], timeout=timeout)
            bwd = dist.new_group([a, b], timeout=timeout)
            if rank == a:
                links.fwd_to_next, links.bwd_from_next = fwd, bwd
            elif rank == b:
                links.fwd_from_prev, links.bwd_to_prev = fwd, bwd
    return links


@dataclass
class Timings:
    """Seconds spent in one step's pipeline, by kind."""

    compute_s: float = 0.0
    recv_wait_s: float = 0.0
    send_wait_s: float = 0.0
    peak_stored: int = 0
    codec_s: float = 0.0  # compressing and decompressing messages
    sent_bytes: int = 0  # bytes this rank put on its pipeline links
    cpu_s: float = 0.0  # the whole step's CPU time, every thread of the process (train.py)

    def add(self, other: Timings) -> None:
        self.compute_s += other.compute_s
        self.recv_wait_s += other.recv_wait_s
        self.send_wait_s += other.send_wait_s
        self.peak_stored = max(self.peak_stored, other.peak_stored)
        self.codec_s += other.codec_s
        self.sent_bytes += other.sent_bytes


@dataclass
class _Recv:
    buf: torch.Tensor
    work: dist.Work | None
    codec: TensorCodec | None = None  # None: `buf` holds the tensor itself


@dataclass
class StepState:
    """What one training step carries between its forward and backward operations."""

    inputs: list[torch.Tensor]
    targets: list[torch.Tensor]
    times: Timings
    fwd_recvs: list[_Recv | None] = field(default_factory=list)
    bwd_recvs: list[_Recv | None] = field(default_factory=list)
    stored: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = field(default_factory=dict)
    loss_sum: float = 0.0
    step: int = 0  # keys the stochastic rounding of gradients sent back (int4h)
    # the weights its forwards run on (`--pipeline-delay 1`: a copy, delayed.py); None: the
    # stage's own
    params: dict[str, torch.Tensor] | None = None
    backwards: int = 0  # backward passes run so far
    # where its messages are tallied (None: the pipeline's `tally`): a step that does not
    # flush tallies apart, so both ends of a link count its gradients in the same step
    tally: LinkTally | None = None

    @property
    def loss(self) -> float:
        """The micro-batch-averaged loss (the last stage's; 0.0 elsewhere)."""
        return self.loss_sum / len(self.inputs)


@dataclass
class Pipeline:
    """Runs one stage's part of a pipelined step."""

    stage: Stage
    links: Links
    stage_index: int
    stages: int
    micro_size: int
    device: torch.device
    autocast_dtype: torch.dtype | None = None
    comm_dtype: torch.dtype = torch.float32
    # how long one receive or send drain may block (deadline.py: adapts to the step time)
    deadline: Deadline = field(default_factory=lambda: Deadline.fixed(DEFAULT_CEILING_S))
    slowdown: float = 1.0  # >1 emulates a slower device (DTFM_COMPUTE_SLOWDOWN)
    codec_prev: TensorCodec | None = None  # the link to the previous stage (None: exact)
    codec_next: TensorCodec | None = None  # the link to the next stage
    # what this end saw cross its links, for the coordinator's check of both ends
    # (linkstats.py; None: not tallied), and the rehearsal seam's attack on what it sends
    # (fault.py: `attack(figure, tensor)`, applied before the tally unless it `lies`)
    tally: LinkTally | None = None
    attack: Any = None
    _sends: list[dist.Work] = field(default_factory=list)
    # the next step's receives, posted with this one's by a step that does not flush
    _next_recvs: tuple[list[_Recv | None], list[_Recv | None]] | None = None

    def _computed(self, t: Timings, t0: float) -> None:
        """Count compute since `t0`; on an emulated slower device, idle for the difference
        (idling, not spinning, so emulated devices sharing cores do not slow each other).
        What is counted is the time that really passed, oversleeping included: on a busy
        machine a sleeper wakes late, and the step model refreshed with this figure must
        see the time the device really held its pipeline."""
        if self.slowdown > 1.0:
            time.sleep((time.perf_counter() - t0) * (self.slowdown - 1.0))
        t.compute_s += time.perf_counter() - t0

    # ---- communication ----
    def _act_shape(self) -> tuple[int, int, int]:
        return (self.micro_size, self.stage.seq_len, self.stage.d_model)

    def _post_recv(
        self, src: int | None, group: dist.ProcessGroup | None, tag: int,
        codec: TensorCodec | None = None,
    ) -> _Recv | None:
        if src is None:
            return None
        if codec is None:
            buf = torch.empty(self._act_shape(), dtype=self.comm_dtype, device=self.device)
        else:
            n = math.prod(self._act_shape())
            buf = torch.empty(codec.wire_bytes(n), dtype=torch.uint8, device=self.device)
        return _Recv(buf, dist.irecv(buf, src=src, group=group, tag=tag), codec)

    def _wait(self, r: _Recv | None, t: Timings, what: str, peer: int | None) -> torch.Tensor:
        assert r is not None and r.work is not None
        t0 = time.perf_counter()
        wait_all([r.work], self.deadline,
                 f"stage {self.stage_index}: waiting for {what} from rank {peer}")
        t1 = time.perf_counter()
        t.recv_wait_s += t1 - t0
        if r.codec is not None:
            shape = self._act_shape()
            x = r.codec.decode(r.buf, math.prod(shape)).view(shape)
            t.codec_s += time.perf_counter() - t1
            return x
        return r.buf.float() if r.buf.dtype != torch.float32 else r.buf

    def _send(
        self, x: torch.Tensor, dst: int | None, group: dist.ProcessGroup | None, tag: int,
        t: Timings, codec: TensorCodec | None = None, key: int | None = None,
    ) -> None:
        if dst is None:
            return
        self._sends = [w for w in self._sends if not w.is_completed()]
        if codec is None:
            msg = x.detach().to(self.comm_dtype).contiguous()
        else:
            t0 = time.perf_counter()
            msg = codec.encode(x, key)
            t.codec_s += time.perf_counter() - t0
        t.sent_bytes += msg.numel() * msg.element_size()
        self._sends.append(dist.isend(msg, dst, group, tag))

    def _drain_sends(self, t: Timings) -> None:
        t0 = time.perf_counter()
        peers = [r for r in (self.links.prev, self.links.next) if r is not None]
        wait_all(self._sends, self.deadline,
                 f"stage {self.stage_index}: delivering its messages to ranks {peers}")
        self._sends.clear()
        t.send_wait_s += time.perf_counter() - t0

    def _outgoing(self, figure: str, t: torch.Tensor, st: StepState) -> torch.Tensor:
        """`t` as this rank sends it (a rehearsed attack, `attack`), tallied (`tally`)."""
        att = self.attack
        if att is not None and not att.lies:
            t = att(figure, t)
        if (tally := st.tally or self.tally) is not None:
            tally.add(figure, t)
        return att(figure, t) if att is not None and att.lies else t

    @contextlib.contextmanager
    def _autocast(self) -> Iterator[None]:
        if self.autocast_dtype is None:
            yield
        else:
            with torch.autocast(self.device.type, dtype=self.autocast_dtype):
                yield

    # ---- schedules ----
    def train_step(
        self,
        kind: str,
        inputs: list[torch.Tensor],
        targets: list[torch.Tensor],
        before_last_backward: Callable[[float], None] | None = None,
        step: int = 0,
    ) -> tuple[float, Timings]:
        """Forward+backward of every micro-batch; gradients accumulate in the stage.

        `before_last_backward(loss)` runs just before the step's last backward pass, when the
        loss (micro-batch-averaged on the last stage; 0.0 elsewhere) is already known: the
        data-parallel averager arms its gradient hooks there. `step` keys the stochastic
        rounding of the gradients sent back (int4h), so a seeded run repeats, resumed or not.
        Returns the loss and timings.
        """
        micro = len(inputs)
        st = StepState(inputs, targets, Timings(), step=step)
        # Every receive of the step is posted up front: gloo sends a message only once it
        # knows the receiver is ready, so a receive posted late costs a one-way delay more.
        st.fwd_recvs, st.bwd_recvs = self._post_step_recvs(micro)
        ops = pipeline_ops(kind, self.stage_index, self.stages, micro)
        for n, (op, i) in enumerate(ops):
            if op == "F":
                self._forward(st, i)
                continue
            if n == len(ops) - 1 and before_last_backward is not None:
                before_last_backward(st.loss_sum / micro)
            self._backward(st, i)
        self._drain_sends(st.times)
        return st.loss_sum / micro, st.times

    def delayed_step(
        self, inputs: list[torch.Tensor], targets: list[torch.Tensor], *, step: int,
        params: dict[str, torch.Tensor], carry: StepState | None, flush: bool,
        grads_done: Callable[[StepState], None], tally: LinkTally | None = None,
    ) -> tuple[StepState | None, Timings]:
        """One step of 1F1B without a flush after it (`--pipeline-delay 1`,
        `layout.delayed_step_ops`): its forwards run on `params` (a copy of the weights,
        where its gradients accumulate) and interleave with the cool-down backwards of
        `carry`, the step before. `grads_done(state)` runs as a step's last backward ends
        (the step before's, or with `flush` or on the last stage this one's). Returns this
        step's state for the next call (None after a flush) and this call's timings. Its
        messages go to `tally` (None: the pipeline's).
        """
        t = Timings()
        st = StepState(inputs, targets, t, step=step, params=params, tally=tally)
        if self._next_recvs is not None:
            st.fwd_recvs, st.bwd_recvs = map(list, self._next_recvs)
        else:
            st.fwd_recvs, st.bwd_recvs = self._post_step_recvs(len(inputs))
        # posted a step ahead: the step before's ranks upstream start this one's sends
        # while this rank still finishes the step before
        self._next_recvs = None if flush else self._post_step_recvs(len(inputs))
        if carry is not None:
            carry.times = t
        for op, offset, i in delayed_step_ops(self.stage_index, self.stages, len(inputs),
                                              carried=carry is not None, flush=flush):
            of = st if offset == 0 else carry
            assert of is not None
            if op == "F":
                self._forward(of, i)
                held = len(st.stored) + (len(carry.stored) if carry is not None else 0)
                t.peak_stored = max(t.peak_stored, held)  # both steps' activations
                continue
            self._backward(of, i)
            if of.backwards == len(of.inputs):
                grads_done(of)
        if flush:
            self._drain_sends(t)
            return None, t
        return st, t

    def _post_step_recvs(self, micro: int) -> tuple[list[_Recv | None], list[_Recv | None]]:
        ln = self.links
        return ([self._post_recv(ln.prev, ln.fwd_from_prev, TAG_ACT, self.codec_prev)
                 for _ in range(micro)],
                [self._post_recv(ln.next, ln.bwd_from_next, TAG_GRAD, self.codec_next)
                 for _ in range(micro)])

    def _forward(self, st: StepState, i: int) -> None:
        ln, micro, t = self.links, len(st.inputs), st.times
        x_in: torch.Tensor | None = None
        if ln.prev is None:
            x = st.inputs[i].to(self.device, non_blocking=True)
        else:
            x = self._wait(st.fwd_recvs[i], t, f"activations of micro-batch {i}", ln.prev)
            if (tally := st.tally or self.tally) is not None:
                tally.add("act_in", x)
            x = x_in = x.requires_grad_(True)
            st.fwd_recvs[i] = None
        t0 = time.perf_counter()
        with self._autocast():
            out = self.stage(x) if st.params is None else \
                torch.func.functional_call(self.stage, st.params, (x,))
            if ln.next is None:
                out = lm_loss(out, st.targets[i].to(self.device, non_blocking=True))
        self._computed(t, t0)
        if ln.next is None:
            st.loss_sum += float(out.detach())
            out = out / micro
        else:
            self._send(self._outgoing("act_out", out.detach(), st), ln.next, ln.fwd_to_next,
                       TAG_ACT, t, self.codec_next)
        st.stored[i] = (x_in, out)
        t.peak_stored = max(t.peak_stored, len(st.stored))

    def _backward(self, st: StepState, i: int) -> None:
        ln, t = self.links, st.times
        x_in, out = st.stored.pop(i)
        if ln.next is None:
            t0 = time.perf_counter()
            out.backward()
        else:
            grad = self._wait(st.bwd_recvs[i], t, f"gradients of micro-batch {i}", ln.next)
            if (tally := st.tally or self.tally) is not None:
                tally.add("grad_in", grad)
            st.bwd_recvs[i] = None
            t0 = time.perf_counter()
            out.backward(grad.to(out.dtype))
        self._computed(t, t0)
        st.backwards += 1
        if x_in is not None:
            assert x_in.grad is not None
            self._send(self._outgoing("grad_out", x_in.grad, st), ln.prev, ln.bwd_to_prev,
                       TAG_GRAD, t, self.codec_prev, key=(st.step << 20) + i)

    @torch.no_grad()
    def eval_step(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> float:
        """Forward-only pass of every micro-batch; micro-batch-averaged loss on the last stage."""
        t = Timings()
        ln = self.links
        loss_sum = 0.0
        for i in range(len(inputs)):
            if ln.prev is None:
                x = inputs[i].to(self.device)
            else:
                recv = self._post_recv(ln.prev, ln.fwd_from_prev, TAG_ACT)
                x = self._wait(recv, t, "eval activations", ln.prev)
            with self._autocast():
                out = self.stage(x)
                if ln.next is None:
                    loss_sum += float(lm_loss(out, targets[i].to(self.device)))
            if ln.next is not None:
                self._send(out, ln.next, ln.fwd_to_next, TAG_ACT, t)  # exact: see the docstring
        self._drain_sends(t)
        return loss_sum / len(inputs)
