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
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
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
                 momentum: float) -> None:
        if every < 2:
            raise ValueError(f"local steps need --sync-every >= 2, got {every}")
        self.every, self.lr, self.mu = every, lr, momentum
        self.averager = averager
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.anchor = [p.detach().clone() for p in self.params]
        self.momentum = [torch.zeros_like(p) for p in self.params]
        self.rounds = 0  # sync points passed since step 0 of the job

    def due(self, step: int, last: int) -> bool:
        return sync_due(step, self.every, last)

    def sync(self, step: int) -> SyncResult:
        """Average the pseudo-gradients over the stage's replicas and take the outer step."""
        with torch.no_grad():
            for p, a in zip(self.params, self.anchor, strict=True):
                p.grad = a - p.detach()
            drift = math.sqrt(sum(float(p.grad.double().square().sum())  # type: ignore[union-attr]
                                  for p in self.params))
            dp_s, _ = self.averager.average_()
            for p, a, m in zip(self.params, self.anchor, self.momentum, strict=True):
                assert p.grad is not None
                outer_step_(a, p.grad, m, self.lr, self.mu)
                p.copy_(a)
                p.grad = None
            checksum = sum(float(p.double().sum()) for p in self.params)
        self.rounds = round_of(step, self.every)
        return SyncResult(dp_s, self.averager.sent_bytes, self.averager.codec_s, drift, checksum)

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

