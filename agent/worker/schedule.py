"""Pipeline schedules (GPipe and 1F1B) over torch.distributed point-to-point messages.

Owns the order in which a stage runs its micro-batches' forward and backward passes and the
activation/gradient traffic with its neighbours. Each direction of each pipeline link gets
its own two-rank process group, so activations and gradients never queue behind each other
(with NCCL, where one communicator serialises its sends and receives, that is what keeps
1F1B free of deadlock). Receives are posted one micro-batch ahead (`irecv`) and sends are
asynchronous (`isend`), so receive, compute and send overlap as far as the backend allows.

Both schedules run backward passes in micro-batch order 0..M-1, so they accumulate the same
gradients in the same order and give bit-identical results; they differ only in when the
backward passes happen (GPipe: after all forwards; 1F1B: interleaved, which bounds stored
activations at S - stage micro-batches instead of M).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from agent.worker.stage import Stage, lm_loss


@dataclass
class Links:
    """This rank's pipeline neighbours and the one-direction groups to reach them."""

    prev: int | None = None
    next: int | None = None
    fwd_from_prev: dist.ProcessGroup | None = None  # activations in
    bwd_to_prev: dist.ProcessGroup | None = None  # gradients out
    fwd_to_next: dist.ProcessGroup | None = None  # activations out
    bwd_from_next: dist.ProcessGroup | None = None  # gradients in


def make_links(pipelines: list[list[int]], rank: int) -> Links:
    """Create every pipeline link group (all ranks must call this, in the same order)."""
    links = Links()
    for ranks in pipelines:
        for a, b in zip(ranks, ranks[1:], strict=False):
            fwd = dist.new_group([a, b])
            bwd = dist.new_group([a, b])
            if rank == a:
                links.next, links.fwd_to_next, links.bwd_from_next = b, fwd, bwd
            elif rank == b:
                links.prev, links.fwd_from_prev, links.bwd_to_prev = a, fwd, bwd
    return links


@dataclass
class Timings:
    """Seconds spent in one step's pipeline, by kind."""

    compute_s: float = 0.0
    recv_wait_s: float = 0.0
    send_wait_s: float = 0.0
    peak_stored: int = 0

    def add(self, other: Timings) -> None:
        self.compute_s += other.compute_s
        self.recv_wait_s += other.recv_wait_s
        self.send_wait_s += other.send_wait_s
        self.peak_stored = max(self.peak_stored, other.peak_stored)


def schedule_ops(kind: str, stage: int, stages: int, micro: int) -> list[tuple[str, int]]:
    """The ("F"|"B", micro-batch) sequence a stage runs in one step."""
    if kind == "gpipe":
        return [("F", i) for i in range(micro)] + [("B", i) for i in range(micro)]
    if kind != "1f1b":
        raise ValueError(f"unknown schedule {kind!r}; use 'gpipe' or '1f1b'")
    warmup = min(stages - stage - 1, micro)
    ops = [("F", i) for i in range(warmup)]
    f, b = warmup, 0
    while f < micro:
        ops += [("F", f), ("B", b)]
        f, b = f + 1, b + 1
    ops += [("B", i) for i in range(b, micro)]
    return ops


@dataclass
class _Recv:
    buf: torch.Tensor
    work: dist.Work | None


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
    timeout: timedelta = timedelta(seconds=300)
    _sends: list[dist.Work] = field(default_factory=list)

    # ---- communication ----
    def _act_shape(self) -> tuple[int, int, int]:
        return (self.micro_size, self.stage.seq_len, self.stage.d_model)

    def _post_recv(self, src: int | None, group: dist.ProcessGroup | None) -> _Recv | None:
        if src is None:
            return None
        buf = torch.empty(self._act_shape(), dtype=self.comm_dtype, device=self.device)
        return _Recv(buf, dist.irecv(buf, src=src, group=group))

    def _wait(self, r: _Recv | None, t: Timings, what: str, peer: int | None) -> torch.Tensor:
        assert r is not None and r.work is not None
        t0 = time.perf_counter()
        try:
            r.work.wait(self.timeout)
        except RuntimeError as e:
            raise RuntimeError(
                f"stage {self.stage_index} got no {what} from rank {peer} "
                f"(timeout {self.timeout.total_seconds():g}s, or the peer died): {e}"
            ) from e
        t.recv_wait_s += time.perf_counter() - t0
        return r.buf

    def _send(self, x: torch.Tensor, dst: int | None, group: dist.ProcessGroup | None) -> None:
        if dst is None:
            return
        self._sends = [w for w in self._sends if not w.is_completed()]
        self._sends.append(dist.isend(x.detach().to(self.comm_dtype).contiguous(), dst, group))

    def _drain_sends(self, t: Timings) -> None:
        t0 = time.perf_counter()
        for w in self._sends:
            w.wait(self.timeout)
        self._sends.clear()
        t.send_wait_s += time.perf_counter() - t0

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
    ) -> tuple[float, Timings]:
        """Forward+backward of every micro-batch; gradients accumulate in the stage.

        Returns the micro-batch-averaged loss (last stage; 0.0 elsewhere) and timings.
        """
        micro = len(inputs)
        t = Timings()
        ln = self.links
        ops = schedule_ops(kind, self.stage_index, self.stages, micro)
        fwd_recv = self._post_recv(ln.prev, ln.fwd_from_prev)
        bwd_recv = self._post_recv(ln.next, ln.bwd_from_next)
        stored: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        loss_sum = 0.0
        for op, i in ops:
            if op == "F":
                if ln.prev is None:
                    x_in: torch.Tensor | None = None
                    x = inputs[i].to(self.device, non_blocking=True)
                else:
                    x = self._wait(fwd_recv, t, f"activations of micro-batch {i}", ln.prev)
                    x = x.requires_grad_(True)
                    x_in = x
                    fwd_recv = (
                        self._post_recv(ln.prev, ln.fwd_from_prev) if i + 1 < micro else None
                    )
                t0 = time.perf_counter()
                with self._autocast():
                    out = self.stage(x)
                    if ln.next is None:
                        out = lm_loss(out, targets[i].to(self.device, non_blocking=True))
                t.compute_s += time.perf_counter() - t0
                if ln.next is None:
                    loss_sum += float(out.detach())
                    out = out / micro
                else:
                    self._send(out, ln.next, ln.fwd_to_next)
                stored[i] = (x_in, out)
                t.peak_stored = max(t.peak_stored, len(stored))
            else:
                x_in, out = stored.pop(i)
                if ln.next is None:
                    t0 = time.perf_counter()
                    out.backward()
                else:
                    grad = self._wait(bwd_recv, t, f"gradients of micro-batch {i}", ln.next)
                    bwd_recv = (
                        self._post_recv(ln.next, ln.bwd_from_next) if i + 1 < micro else None
                    )
                    t0 = time.perf_counter()
                    out.backward(grad.to(out.dtype))
                t.compute_s += time.perf_counter() - t0
                if x_in is not None:
                    assert x_in.grad is not None
                    self._send(x_in.grad, ln.prev, ln.bwd_to_prev)
        self._drain_sends(t)
        return loss_sum / micro, t

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
                x = self._wait(
                    self._post_recv(ln.prev, ln.fwd_from_prev), t, "eval activations", ln.prev
                )
            with self._autocast():
                out = self.stage(x)
                if ln.next is None:
                    loss_sum += float(lm_loss(out, targets[i].to(self.device)))
            if ln.next is not None:
                self._send(out, ln.next, ln.fwd_to_next)
        self._drain_sends(t)
        return loss_sum / len(inputs)
