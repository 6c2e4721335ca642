"""`--pipeline-delay 1`: steps that do not flush the pipeline (PipeDream-2BW).

A flushed step ends only when its first stage's last backward is done: on slow links every
step pays the pipeline's fill and drain, one-way delays that no codec takes back
(docs/benchmarks.md, "Where the step goes"). Here a stage starts the next step's forwards
while the step before still drains (`layout.delayed_step_ops`), so those delays are paid once
per flush instead of once per step.

What is trained changes, in one well-defined way (Narayanan et al. 2021, PipeDream-2BW):
step t's forwards and backwards all run on one copy of the weights (`Versions`), on every
stage alike, and its gradient updates the newest weights. The copy is the weights after step
t - 2 moved by step t - 1's update as AdamW's moments predict it, since that update is still
in flight (SpecTrain's weight prediction, Chen et al. 2018: plain 2BW, the weights after
t - 2 as they are, lost 9-21 % validation loss on gpt-mini where this loses 8 %:
docs/benchmarks.md). So every micro-batch sees one consistent model, and the update is exact
for it but about one step stale. The global-norm clip stays exact: a stage sends its
squared norm as its gradients are complete and reads the table only when the update is due,
before step t + 2's first forward, a step's time later. A flush (the learning rate's warm-up, where
staleness costs most; sync points, evaluations,
checkpoints, the last step) applies every pending update, so checkpoints, evaluations and
outer steps see the same state a flushed run would hold at that step, and a run resumed from
a checkpoint repeats an uninterrupted one.

Only local steps (or one replica): replicas average only at sync points, which flush. Step
events leave one or two steps late, when the step's update is applied, with the times of the
pass that ran the step's forwards.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from agent.worker import globalnorm
from agent.worker.data import Sampler, replica_slice
from agent.worker.linkstats import LinkTally
from agent.worker.optim import clip_, local_sq_norm, lr_at, predict_step_, set_lr
from agent.worker.outer import SyncResult
from agent.worker.pipeline import Pipeline, StepState, Timings
from agent.worker.world import Exchange, World


class Versions:
    """Copies of a stage's trainable weights for the steps in flight (at most two), reused."""

    def __init__(self, stage: nn.Module) -> None:
        named = [(n, p) for n, p in stage.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.live = [p for _, p in named]
        self._free: list[dict[str, torch.Tensor]] = []

    def snapshot(self, ahead: tuple[torch.optim.Optimizer, float] | None = None
                 ) -> dict[str, torch.Tensor]:
        """The live weights, copied into leaves that collect a step's gradients; with
        `ahead` (the optimizer and the learning rate of an update still in flight), moved
        by that update as the optimizer's moments predict it (`optim.predict_step_`)."""
        if self._free:
            copy = self._free.pop()
            with torch.no_grad():
                for t, p in zip(copy.values(), self.live, strict=True):
                    t.copy_(p)
                    t.grad = None
        else:
            copy = {n: p.detach().clone().requires_grad_(True)
                    for n, p in zip(self.names, self.live, strict=True)}
        if ahead is not None:
            predict_step_(copy.values(), self.live, *ahead)
        return copy

    def hand_over(self, copy: dict[str, torch.Tensor]) -> None:
        """Move the gradients `copy` collected onto the live weights; `copy` is free again."""
        for p, t in zip(self.live, copy.values(), strict=True):
            p.grad, t.grad = t.grad, None
        self._free.append(copy)


@dataclass
class Pass:
    """One step's pass and what it ran, from its start until its update is applied: its
    step event reports the pass (the step's own timings), whenever the update comes."""

    step: int
    lr: float
    params: dict[str, torch.Tensor]
    posted: Exchange  # the norm exchange's receives, posted at the step's start
    exchange: Exchange | None = None  # started once its gradients are complete
    times: Timings = field(default_factory=Timings)
    # wall-clock seconds of the whole pass (the worker sets it: the updates applied and the
    # outer step in it too), and of that the waits for norm tables (at a flush: the drain)
    dt: float = 0.0
    wait_s: float = 0.0
    tally: LinkTally | None = None  # its pipeline messages (None: not tallied)
    outer_s: float = 0.0  # its sync point's outer step (the worker sets both)
    synced: SyncResult | None = None  # what that sync exchanged


@dataclass(frozen=True)
class Applied:
    """A step's update, applied: what its step event reports (with its `Pass`)."""

    step: int
    loss: float
    norm: float
    lr: float
    of: Pass


@dataclass
class DelayedSteps:
    """Runs one stage's steps without flushing between them, updates applied when due."""

    pipe: Pipeline
    stage: nn.Module
    world: World
    opt: torch.optim.Optimizer
    sampler: Sampler
    total_steps: int
    global_batch: int
    micro_batches: int
    lr: float
    warmup_steps: int
    grad_clip: float
    replica: int
    replicas: int
    last: bool  # the last stage: its loss goes into the norm table
    versions: Versions
    # the fault seam's scale of what this rank sends in the exchange (step -> scale or None)
    sent_scale: Callable[[int], Sequence[float] | None] = lambda step: None
    predict: bool = True  # forwards on the weights the update in flight will about give
    _carry: StepState | None = None  # the pipeline's state of the step before, draining
    _steps: deque[Pass] = field(default_factory=deque)
    _tallied: deque[Pass] = field(default_factory=deque)  # steps whose figures are not out
    _waited: float = 0.0  # this pass's waits for norm tables so far
    current: Pass | None = None  # the newest step's pass

    def run(self, step: int, flush: bool) -> list[Applied]:
        """Step `step`'s pass (with the cool-down of the step before), after the updates
        due before its first forward; with `flush`, every update through `step`. Returns the
        updates applied, oldest first; the pass is `current`, whose `dt` the caller sets."""
        applied: list[Applied] = []
        while self._steps and self._steps[0].step <= step - 2:
            applied.append(self._apply(self._steps.popleft()))
        ids = replica_slice(self.sampler.next_global(self.global_batch), self.replica,
                            self.replicas)
        x, y = self.sampler.windows(ids)
        ahead = (self.opt, self._steps[-1].lr) if self._steps and self.predict else None
        me = Pass(step, lr_at(step - 1, self.lr, self.warmup_steps, self.total_steps),
                   self.versions.snapshot(ahead), self.world.post_exchange(2),
                   tally=LinkTally() if self.pipe.tally is not None else None)
        self._steps.append(me)
        self._tallied.append(me)
        self._carry, me.times = self.pipe.delayed_step(
            list(x.chunk(self.micro_batches)), list(y.chunk(self.micro_batches)), step=step,
            params=me.params, carry=self._carry, flush=flush, grads_done=self._grads_done,
            tally=me.tally)
        self._hand_over_figures(step, flush)
        if flush:
            while self._steps:
                applied.append(self._apply(self._steps.popleft()))
        me.wait_s, self._waited = self._waited, 0.0
        self.current = me
        return applied

    def _hand_over_figures(self, step: int, flush: bool) -> None:
        """Into the pipeline's tally, which the checks take as this step's (replicacheck.py):
        the figures of the steps every rank has finished by now, the step before (and this
        one at a flush). A stage's last backward of a step comes a pass later on some stages
        than on others; whole steps keep both ends of each link counting the same messages."""
        while self._tallied and (self._tallied[0].step < step or flush):
            done = self._tallied.popleft()
            if done.tally is not None and self.pipe.tally is not None:
                self.pipe.tally.merge(done.tally)

    def _grads_done(self, state: StepState) -> None:
        """A step's last backward ended: send its norm (and loss) to the pipeline now."""
        me = next(s for s in self._steps if s.step == state.step)
        sq = float(local_sq_norm(me.params.values()))
        loss = state.loss if self.last else 0.0
        me.exchange = self.world.start_exchange([sq, loss], me.posted,
                                                self.sent_scale(state.step))

    def _apply(self, me: Pass) -> Applied:
        assert me.exchange is not None, f"step {me.step}'s gradients are not complete"
        t0 = time.perf_counter()
        table = self.world.finish_exchange(me.exchange)
        self._waited += time.perf_counter() - t0
        w = self.world
        norm, loss = globalnorm.checked(table, w.pipeline, w.rank, self.replica, me.step)
        self.versions.hand_over(me.params)
        set_lr(self.opt, me.lr)
        clip_(self.stage, norm, self.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return Applied(me.step, loss, norm, me.lr, me)
