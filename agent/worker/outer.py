"""Local steps and the outer optimizer: sync the replicas every H steps instead of every step.

Owns the round of `--sync-every H` > 1 (DiLoCo): between two sync points each replica of a
stage takes H inner optimizer steps (AdamW, `optim.py`) on its own share of the global batch
with no data-parallel exchange; its pipeline stays exact. At a sync point every replica turns
what it learned into a pseudo-gradient, the anchor (its parameters at the last sync) minus its
parameters now, and the stage's replicas average it through the very exchange synchronous
training averages gradients with (`data_parallel.GradAverager`: buckets, sharded or ring,
uneven shares, the codecs and their error feedback). Each then takes the same outer step, SGD
with Nesterov momentum (`outer_step_`), on the anchor and copies the result into its
parameters, so all replicas leave the sync point holding the same bits. Traffic falls by H;
the learning-rate schedule and the global batch keep their meaning, since every inner step
still consumes one global batch, cut over the replicas as before.

Sync points are the steps that are multiples of H, and the last step, counted from step 0 of
the job, so a run resumed from a checkpoint keeps the rounds where they were (the rule is
`dtfm.core.rounds`, which the coordinator reads too). Checkpoints are
taken only at sync points (the worker defers a request that falls inside a round) and hold the
outer state (`state_dict`): the anchor is the model they already hold, plus the momentum by
parameter name (so a re-split can regroup it). The replicas' inner AdamW states differ, and a
checkpoint holds one of them: so at a checkpoint the replicas first average their AdamW moments
(`average_moments`, exact, through an uncompressed averager), and every replica resumes from
the state it would have continued with. A replica lost mid-round loses its unsynced inner
steps: the job resumes from the last sync point's checkpoint.

`--outer-delay 1` (eager, one round late; Kale et al. 2025, "Eager updates for overlapped
communication and computation in DiLoCo"; DiLoCoX's one-step-delay overlap): a sync point
starts averaging its round's pseudo-gradient and returns at once, so the exchange runs while
the next round trains (`GradAverager.launch`, `progress` between inner steps to send the
averages back as soon as the copies are in, `collect` at the next sync point). Each replica
keeps the anchor (the global model, the same bits on every replica) and trains on from the
anchor minus its own newest pseudo-gradient, the eager stand-in for the average still in
flight. At the next sync point it collects that average, takes the outer step with it on the
anchor, one round late, and starts over from the new anchor minus the round just ended. So a
round's progress is counted once: locally while its average travels, then through the average.
The replicas' working weights differ by their own newest round; their anchors agree bit for
bit, and the weights digest and the checksum compare the anchors. A checkpoint or the last
step flushes: it collects the exchange in flight and averages the round just ended at once,
so the replicas leave it holding the anchor, the same bits, and a run resumed there continues
as the flushed run does. What a replica holds apart from a synchronous round (the pseudo-
gradient in flight) is one more copy of the trained parameters.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from agent.worker.data_parallel import GradAverager
from agent.worker.optim import MOMENTS
from dtfm.core.rounds import round_of, sync_due


def outer_step_(anchor: torch.Tensor, delta: torch.Tensor, momentum: torch.Tensor,
                lr: float, mu: float) -> None:
    """One SGD step with Nesterov momentum on `anchor`, in place, for the averaged
    pseudo-gradient `delta` (anchor minus the replicas' parameters): torch.optim.SGD's rule
    with dampening 0, `momentum` starting at zero:

        m <- mu * m + delta;  anchor <- anchor - lr * (delta + mu * m)
    """
    momentum.mul_(mu).add_(delta)
    anchor.sub_(delta.add(momentum, alpha=mu), alpha=lr)


@dataclass(frozen=True)
class SyncResult:
    """What one sync point did, for the step event."""

    dp_s: float  # seconds averaging the pseudo-gradient
    dp_bytes: int  # bytes sent to the data-parallel peers
    codec_s: float
    drift: float  # the norm of this replica's own pseudo-gradient (this stage's part)
    checksum: float  # of the parameters after the step: equal on every replica of the stage


class OuterSync:
    """The outer optimizer of one stage on one replica: anchor, momentum, rounds."""

    def __init__(self, model: nn.Module, averager: GradAverager, *, every: int, lr: float,
                 momentum: float, delay: int = 0) -> None:
        if every < 2:
            raise ValueError(f"local steps need --sync-every >= 2, got {every}")
        if delay not in (0, 1):
            raise ValueError(f"--outer-delay must be 0 or 1, got {delay}")
        self.every, self.lr, self.mu, self.delay = every, lr, momentum, delay
        self.averager = averager
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.anchor = [p.detach().clone() for p in self.params]
        self.momentum = [torch.zeros_like(p) for p in self.params]
        self.rounds = 0  # sync points passed since step 0 of the job
        # delay 1: this replica's pseudo-gradient whose average is in flight (None: nothing)
        self.pending: list[torch.Tensor] | None = None
        self.pending_step = 0  # the sync point that launched it

    def due(self, step: int, last: int) -> bool:
        return sync_due(step, self.every, last)

    def synced(self) -> list[torch.Tensor]:
        """The weights every replica of the stage holds the same bits of after a sync point:
        the parameters, or with a delayed outer step the anchor (the parameters differ by each
        replica's own newest round)."""
        held: list[torch.Tensor] = self.anchor if self.delay else list(self.params)
        return held

    def sync(self, step: int, *, flush: bool = False) -> SyncResult:
        """Average the pseudo-gradients over the stage's replicas and take the outer step
        (delay 1: the previous round's, and start this round's; with `flush`,
        both, leaving every replica on the anchor)."""
        if self.delay:
            return self._sync_late(step, flush)
        with torch.no_grad():
            grads = [a - p.detach() for p, a in zip(self.params, self.anchor, strict=True)]
            for p, g in zip(self.params, grads, strict=True):
                p.grad = g
            drift = _norm(grads)
            dp_s, _ = self.averager.average_()
            for p, a, m in zip(self.params, self.anchor, self.momentum, strict=True):
                assert p.grad is not None
                outer_step_(a, p.grad, m, self.lr, self.mu)
                p.copy_(a)
                p.grad = None
            checksum = sum(float(p.double().sum()) for p in self.params)
        self.rounds = round_of(step, self.every)
        return SyncResult(dp_s, self.averager.sent_bytes, self.averager.codec_s, drift, checksum)

    def progress(self) -> None:
        """Between inner steps: move the exchange in flight on (`GradAverager.progress`)."""
        if self.pending is not None:
            self.averager.progress()

    def _sync_late(self, step: int, flush: bool) -> SyncResult:
        with torch.no_grad():
            # this round's pseudo-gradient, from where the round started: the anchor minus
            # the round before's (its average still in flight)
            delta = [a - p.detach() for p, a in zip(self.params, self.anchor, strict=True)]
            if self.pending is not None:
                for d, prev in zip(delta, self.pending, strict=True):
                    d.sub_(prev)
            drift = _norm(delta)
        dp_s, sent, codec_s = self._collect() if self.pending is not None else (0.0, 0, 0.0)
        self.averager.step = step  # a peer's bad value in it is blamed at its sync point
        with self._as_grads(delta):
            t0 = time.perf_counter()
            if flush:  # average this round's at once: every replica ends on the anchor
                self.averager.average_()
            else:
                self.averager.launch()
            dp_s += time.perf_counter() - t0
        if flush:
            sent, codec_s = sent + self.averager.sent_bytes, codec_s + self.averager.codec_s
            self._outer(delta)  # the means were written into it
        else:
            self.pending, self.pending_step = delta, step
        with torch.no_grad():  # the eager stand-in: the anchor minus my round in flight
            for p, a, d in zip(self.params, self.anchor, delta, strict=True):
                p.copy_(a)
                if not flush:
                    p.sub_(d)
        self.rounds = round_of(step, self.every)
        return SyncResult(dp_s, sent, codec_s, drift, self._checksum())

    def _collect(self) -> tuple[float, int, float]:
        """Collect the average in flight into the pending tensors and take its outer step
        on the anchor: (seconds, bytes sent, codec seconds) of that exchange."""
        assert self.pending is not None
        self.averager.step = self.pending_step
        with self._as_grads(self.pending):  # my copy again: the receivers' check reads it
            dp_s = self.averager.collect()  # ... and the means land there
        self._outer(self.pending)
        self.pending = None
        return dp_s, self.averager.sent_bytes, self.averager.codec_s

    @contextmanager
    def _as_grads(self, tensors: Sequence[torch.Tensor]) -> Iterator[None]:
        """The parameters' gradients are `tensors` inside (what the averager reads and
        writes), the inner step's again after."""
        saved = [p.grad for p in self.params]
        for p, t in zip(self.params, tensors, strict=True):
            p.grad = t
        try:
            yield
        finally:
            for p, g in zip(self.params, saved, strict=True):
                p.grad = g

    def _outer(self, averaged: Sequence[torch.Tensor]) -> None:
        with torch.no_grad():
            for a, d, m in zip(self.anchor, averaged, self.momentum, strict=True):
                outer_step_(a, d, m, self.lr, self.mu)

    def _checksum(self) -> float:
        """Of the weights every replica holds the same bits of (`synced`)."""
        with torch.no_grad():
            return sum(float(w.double().sum()) for w in self.synced())

    # ---- checkpoints ----
    def state_dict(self) -> dict[str, Any]:
        """The outer state a checkpoint holds (the anchor is its model: saved at sync points)."""
        return {"every": self.every, "rounds": self.rounds,
                "momentum": {n: m.detach().cpu() for n, m in
                             zip(self.names, self.momentum, strict=True)}}

    def momentum_norm(self) -> float:
        """The outer momentum's L2 norm: 0 before the first round, or where a resume found
        no outer state (the logs say which, so a lost state cannot pass unseen)."""
        return math.sqrt(sum(float(m.double().pow(2).sum()) for m in self.momentum))

    def load(self, states: Sequence[Mapping[str, Any] | None]) -> None:
        """Resume from the outer states of the checkpoints this stage's layers came from (one,
        or several after a re-split), after the model was loaded: the anchor is the model.
        A checkpoint without one (written by synchronous training) starts the momentum at 0."""
        momentum: dict[str, torch.Tensor] = {}
        for st in states:
            if st is not None:
                momentum.update(st["momentum"])
        with torch.no_grad():
            for n, p, a, m in zip(self.names, self.params, self.anchor, self.momentum,
                                  strict=True):
                a.copy_(p.detach())
                if n in momentum:
                    m.copy_(momentum[n])
                else:
                    m.zero_()


def average_moments(opt: torch.optim.Optimizer, params: Sequence[nn.Parameter],
                    averager: GradAverager) -> None:
    """Average AdamW's moments over the stage's replicas through `averager` (no codec: a
    second moment must stay exact and positive), so one checkpoint holds every replica's
    inner state. Parameters without state yet (no step taken) are left alone."""
    held = [p for p in params if opt.state.get(p)]
    if averager.size == 1 or not held:
        return
    saved = {p: p.grad for p in params}
    with torch.no_grad():
        for name in MOMENTS:
            for p in params:
                state = opt.state.get(p)
                p.grad = (state[name].to(p.dtype) if state else torch.zeros_like(p))
            averager.average_()
            for p in held:
                assert p.grad is not None
                opt.state[p][name].copy_(p.grad)
    for p, g in saved.items():
        p.grad = g


def _norm(tensors: Sequence[torch.Tensor]) -> float:
    """The L2 norm of `tensors` together, summed in float64 in their order (the drift each
    replica reports: the same bits for the same tensors on every rank)."""
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))
