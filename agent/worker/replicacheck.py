"""The worker's replica checks (`--verify`): what it scores, when, and the evidence it emits.

Owns wiring the checks into a training step, apart from `train.py` (the main loop), so the
checks grow without growing it:

- at a shard's owner (`--verify full` / `robust`, synchronous steps): every replica's copy of
  its shard is scored (`gradscore.py`, through `GradAverager.inspect`); `robust` also averages
  with CenteredClip. With `--sync-every H` the owner sees pseudo-gradients (H AdamW steps each,
  whose honest spread the gradient thresholds were not measured on): only the self-evident
  checks (a zero or a replayed copy) run there, the weights digest carries the rest;
- the weights digest (`digest.py`, every level but `off`): every `DIGEST_EVERY` synchronous
  steps, at every sync point with `--sync-every`, and after the last step, the stage's
  replicas exchange it (`World.dp_gather`) and the odd one out is named (R >= 3), or the
  disagreement reported undecided (R = 2);
- at every replica of such a step, each owner's averaged shard as it arrives, against this
  replica's own copy and the other owners' averages (`avgcheck.py`, through
  `GradAverager.check`): an owner that alters the mean it sends back is named by its
  receivers;
- the averages' audit (`avgaudit.py`, `--verify full`, exact exchanges): every exchange's
  figures of the mean's identity, per owner and copy, travel with the next weights digest
  and every replica judges every owner and contributor alike;
- the rehearsal seam's bad-peer modes (`fault.py`): its attack on outgoing contributions is
  armed as the averager's `tamper` during the step, and `drift` moves a weight after it;
- the pipeline links (every level but `off`, where the rank has a pipeline neighbour): what
  this rank sent and received, tallied by the pipeline (`linkstats.py`) and reported as
  window medians on the step events (`figures`), for the coordinator to check both ends of
  every link (coordinator/integrity/linkwitness.py); the seam's activation attacks
  (`act_*`, `actgrad_*`) are armed on the pipeline (`attach`).

Each failed check is an `IntegrityEvent` (evidence, for the coordinator to weigh); nothing
here stops training. `DTFM_VERIFY_TRACE=FILE` appends every copy's scores as JSON lines
(bench/integrity.py measures the honest distribution with it).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from agent.worker import (
    avgaudit,
    avgcheck,
    badpeer,
    digest,
    gradscore,
    linkstats,
    normtable,
    pairscore,
    scorewindow,
)
from agent.worker.data_parallel import GradAverager
from agent.worker.fault import Fault
from agent.worker.pipeline import Pipeline
from agent.worker.world import Gathering, World
from dtfm.core.events import IntegrityEvent
from dtfm.core.layout import Layout
from dtfm.core.rounds import sync_due
from dtfm.core.verify import AVG_DISAGREE, DIGEST_EVERY, NORM_DIFFERS, Verify, scores

log = logging.getLogger(__name__)

ENV_TRACE = "DTFM_VERIFY_TRACE"


@dataclass
class _Digest:
    """A weights digest posted to the stage's replicas, judged a step later."""

    step: int
    audit_len: int  # the audit's figures in each row, after the digest itself
    covers_from: int  # the first step its records can be of
    gathering: Gathering


class ReplicaChecks:
    """One rank's replica checks over a run."""

    def __init__(self, level: Verify, *, world: World, averager: GradAverager,
                 model: nn.Module, dp_ranks: list[int], rank: int, sync_every: int,
                 emit: Callable[[IntegrityEvent], None], fault: Fault | None = None,
                 epoch: int = 0,
                 weights: Callable[[], Sequence[torch.Tensor]] | None = None) -> None:
        self.level, self.world, self.averager, self.model = level, world, averager, model
        # what the digest compares and a rehearsed drift moves: the weights the replicas hold
        # the same bits of (with a delayed outer step, its anchor: `OuterSync.synced`)
        self.weights = weights or (lambda: list(model.parameters()))
        self.dp_ranks, self.rank, self.sync_every, self.emit = dp_ranks, rank, sync_every, emit
        size = len(dp_ranks)
        self.scorer = gradscore.ShardScorer(size) if scores(level) and size > 1 else None
        self.pair = pairscore.PairJudge()  # R = 2: the copies judged over a window of steps
        self.copy_window = scorewindow.ScoreWindow()  # R >= 3: cosines and quiet energy, likewise
        self.averages = avgcheck.AverageChecker(size, dp_ranks.index(rank)) \
            if self.scorer is not None else None
        # the exact audit needs a mean, sent as computed: not robust aggregation, no codec
        self.audit = avgaudit.AverageAudit(size, dp_ranks.index(rank), shares=sync_every <= 1) \
            if self.scorer is not None and level == Verify.FULL and averager.codec is None \
            else None
        self.fault, self.epoch = fault, epoch
        self.attack = fault.contributions(rank, epoch) if fault else None
        self.avg_attack = fault.contributions(rank, epoch, averages=True) if fault else None
        self.equivocation = fault.equivocation(rank, epoch) if fault else None
        self._trace = os.environ.get(ENV_TRACE, "")
        self.tally: linkstats.LinkTally | None = None
        self.windows = linkstats.LinkWindows()
        self.figures: dict[str, float] = {}  # the step event's link_* fields, when due
        self.pipe_attack: badpeer.Activations | None = None
        stages = len(world.pipeline)
        self.layout = Layout(stages, size)
        # synchronous steps: the pipeline's squared norms, which the replicas' agree on
        self.norms = normtable.NormTable(stages) \
            if level != Verify.OFF and size > 1 and sync_every <= 1 else None
        self.spent_s = 0.0  # this step's seconds in the checks (`take_spent`)
        self._digest: _Digest | None = None  # the weights digest in flight
        self._covered_from: int | None = None  # the first step the next digest covers

    def attach(self, pipe: Pipeline) -> None:
        """Tally `pipe`'s messages for the coordinator (`figures`), and arm a rehearsed
        attack on what it sends."""
        if self.level != Verify.OFF and (pipe.links.prev is not None
                                         or pipe.links.next is not None):
            self.tally = pipe.tally = linkstats.LinkTally()
        if self.fault is not None:
            self.pipe_attack = pipe.attack = self.fault.activations(self.rank, self.epoch)

    def begin_step(self, step: int) -> None:
        """Arm this step's exchange: scoring at the owner, and a rehearsed attack."""
        if self._covered_from is None:
            self._covered_from = step
        if self.pipe_attack is not None:
            self.pipe_attack.step = step
        if self.scorer is not None:
            self.averager.inspect = self._inspect
        if self.averages is not None:
            self.averager.check = self._check_average
        if self.attack is not None:
            self.attack.step = step
            self.averager.tamper = self.attack
        if self.avg_attack is not None:
            self.avg_attack.step = step
            self.averager.tamper_average = self.avg_attack
        if self.equivocation is not None:
            self.equivocation.step = step
            self.averager.tamper_sent = self.equivocation

    def end_step(self, step: int, last: int) -> None:
        """After the optimizer (and outer) step: disarm, judge, and digest when due."""
        t0 = time.perf_counter()
        try:
            self._end_step(step, last)
        finally:
            self.spent_s += time.perf_counter() - t0

    def take_spent(self) -> float:
        """Seconds this step spent in the checks (the step event's `verify_s`), and reset:
        the owner's scoring, the receivers' checks and audit, the link tally, the judging,
        and the digest's exchange with its wait for the stage's replicas."""
        spent, self.spent_s = self.spent_s, 0.0
        if self.tally is not None:
            spent, self.tally.spent_s = spent + self.tally.spent_s, 0.0
        return spent

    def _end_step(self, step: int, last: int) -> None:
        self.figures = {}
        if self.tally is not None and (got := self.windows.add(step, self.tally.take(), last)):
            self.figures = {f"link_{name}": v for name, v in zip(linkstats.FIGURES, got,
                                                                strict=True)}
        self.averager.inspect = self.averager.tamper = None
        self.averager.check = self.averager.tamper_average = self.averager.tamper_sent = None
        if self.fault is not None and self.fault.drifts(self.rank, step, self.epoch):
            log.error("fault injection: rank %d's weights drift after step %d", self.rank, step)
            badpeer.drift_(list(self.weights()))
        if self.scorer is not None:
            inputs_suspect = self._judge(step)
            self._judge_averages(step, inputs_suspect)
        if self.audit is not None:
            self.audit.close_step(step)
        self._judge_digest()  # the previous digest's rows: posted a step ago, here by now
        if self.level != Verify.OFF and len(self.dp_ranks) > 1 and self._digest_due(step, last):
            self._post_digest(step)
            if step == last:  # nothing follows to overlap it with
                self._judge_digest()

    @property
    def judged_through(self) -> int:
        """The newest step whose records are all out, for the step event (-1: every step's
        through the one just ended): a digest in flight judges the steps since the one
        before it, so a checkpoint among them is not vetted before its verdict."""
        return self._digest.covers_from - 1 if self._digest is not None else -1

    # ---- gradient copies at their owner ----
    def _inspect(self, bucket: int, copies: list[torch.Tensor]) -> torch.Tensor | None:
        assert self.scorer is not None
        t0 = time.perf_counter()
        self.scorer.add(bucket, copies)
        if self.audit is not None:
            self.audit.hold(bucket, copies)
        clipped = gradscore.centered_clip(copies) if self.level == Verify.ROBUST else None
        self.spent_s += time.perf_counter() - t0
        return clipped

    def _judge(self, step: int) -> bool:
        """Judge this step's copies of my shard; whether any was found bad."""
        assert self.scorer is not None
        found = self.scorer.scores()
        if not found:
            return False
        if self._trace:
            with open(self._trace, "a", encoding="utf-8") as trace:
                for s in found:
                    trace.write(json.dumps({"step": step, "owner": self.rank,
                                        "rank": self.dp_ranks[s.replica],
                                        "norm_ratio": s.norm_ratio, "cosine": s.cosine,
                                        "shape": s.shape, "quiet": s.quiet,
                                        "sync_every": self.sync_every}) + "\n")
        findings = gradscore.judge(self.copy_window.smooth(found),
                                   scorewindow.WINDOW_COSINE_MIN) + self.pair.judge(found)
        if self.sync_every > 1:  # pseudo-gradients: only the self-evident checks
            findings = [f for f in findings if f.kind in ("grad_zero", "grad_stale")]
        for f in findings:
            suspect = self.dp_ranks[f.replica] if f.replica >= 0 else -1
            who = f"rank {suspect}'s copy" if suspect >= 0 else \
                f"ranks {self.dp_ranks}' copies"
            self._evidence(step, f.kind, suspect, f.score,
                           f"{who} of the gradient shard rank {self.rank} owns: {f.detail}")
        return bool(findings)

    # ---- the owners' averages at their receivers ----
    def _check_average(self, bucket: int, owner: int, average: torch.Tensor,
                       mine: torch.Tensor) -> None:
        assert self.averages is not None
        t0 = time.perf_counter()
        dots = self.averages.add(owner, average, mine)  # taken once, for the audit too
        if self.audit is not None:
            self.audit.add(bucket, owner, average, mine, dots)
        self.spent_s += time.perf_counter() - t0

    def _judge_averages(self, step: int, inputs_suspect: bool) -> None:
        assert self.averages is not None
        found = avgcheck.judge(self.averages.scores(), inputs_suspect=inputs_suspect,
                               statistics=self.sync_every <= 1)
        for f in found:
            owner = self.dp_ranks[f.replica]
            self._evidence(step, f.kind, owner, f.score,
                           f"rank {owner}, the owner of a gradient shard, as its receiver "
                           f"rank {self.rank} saw it: {f.detail}")

    def note_norms(self, step: int, squares: list[float]) -> None:
        """The squared norms this rank's pipeline exchanged at `step` (stage order), for the
        next digest (`normtable.py`)."""
        if self.norms is None:
            return
        if self.fault is not None and self.fault.forges_norm(self.rank, step, self.epoch):
            squares = list(squares)
            other = (self.world.pipeline.index(self.rank) + 1) % len(squares)
            squares[other] *= badpeer.NORM_LIE_SCALE
            log.error("fault injection: rank %d writes another norm of stage %d at step %d in "
                      "its own norm table", self.rank, other, step)
        self.norms.add(step, squares)

    # ---- the weights digest ----
    def _digest_due(self, step: int, last: int) -> bool:
        if self.sync_every > 1:
            return sync_due(step, self.sync_every, last)
        return step % DIGEST_EVERY == 0 or step == last

    def _post_digest(self, step: int) -> None:
        """Send this stage's replicas the weights digest of `step` with the audit's figures
        and the norm table since the last one (`World.post_dp_gather`); `_judge_digest`
        reads the rows at the next step's end. The wait for the slowest replica and the
        round trip between them were nearly all the checks' time on the 16-agent world
        (39 of 44 ms a rank-step), time that training now overlaps; what it costs is a
        verdict one step later."""
        mine = digest.weights_digest(self.weights())
        audit = self.audit.row() if self.audit is not None else []
        norms = self.norms.take() if self.norms is not None else []
        start = self._covered_from if self._covered_from is not None else step
        self._digest = _Digest(step, len(audit), start, self.world.post_dp_gather(
            [float(mine), *audit, *norms]))
        self._covered_from = step + 1

    def _judge_digest(self) -> None:
        """Report the odd one out of the digest in flight, if any."""
        if self._digest is None:
            return
        posted, self._digest = self._digest, None
        step, n_audit = posted.step, posted.audit_len
        rows = posted.gathering.rows()
        digests = [int(row[0]) for row in rows]
        tables = [row[1 + n_audit:] for row in rows]  # every row is as long as mine
        if self.audit is not None:
            for at, f in self.audit.judge([row[1:1 + n_audit] for row in rows]):
                who = self.dp_ranks[f.replica]
                self._evidence(at, f.kind, who, f.score,
                               f"rank {who}, as the stage's replicas' own figures of step {at} "
                               f"show it (rank {self.rank} judging): {f.detail}")
        odd, decided = digest.odd_ones(digests)
        listed = ", ".join(f"rank {r}: {d:012x}" for r, d in zip(self.dp_ranks, digests,
                                                                  strict=True))
        if odd and decided:
            received = self.audit.receivers if self.audit is not None else []
            me = self.world.pipeline.index(self.rank)
            for k in odd:
                if other := next((o for o in received if o.receiver == k), None):
                    self._other_average(other, listed)
                    continue
                upstream = [(at, s) for at, s in normtable.differing(
                    tables, self.layout.stages, k) if s != me]
                if upstream:
                    self._other_norm(k, *upstream[0], listed)
                    continue
                self._evidence(step, "weights", self.dp_ranks[k], float(len(digests) - len(odd)),
                               f"rank {self.dp_ranks[k]}'s weights differ from the "
                               f"{len(digests) - len(odd)} replicas that agree ({listed})")
        elif odd:
            self._evidence(step, "weights_disagree", -1, float(len(set(digests))),
                           f"the replicas' weights differ with no majority ({listed}): a "
                           f"third party must settle which is wrong")

    def _other_average(self, other: avgaudit.OtherAverage, listed: str) -> None:
        """The odd one out of a digest is a receiver that got another average from its owner
        than the owner accounts for: its weights differ for that average. Where the audit
        names the owner, that is the whole story. Where it does not (one receiver against
        one owner), either may have made it up: an owner that sent one receiver another
        average, or a receiver that drifted its weights and reports another. Naming the
        receiver by its digest would exclude an honest one for its owner's equivocation,
        so the two of them report a dispute instead (`avg_disagree`, settled as an R = 2
        pair's is: coordinator/integrity/dispute.py), and no replica names the receiver."""
        receiver, owner = self.dp_ranks[other.receiver], self.dp_ranks[other.owner]
        if other.named:
            log.warning("rank %d: rank %d's weights differ (%s) after the average its owner, "
                        "rank %d, sent it at step %d, which the audit names: not its fault",
                        self.rank, receiver, listed, owner, other.step)
            return
        why = (f"rank {receiver}'s weights differ from its replicas' ({listed}), and the "
               f"average rank {owner} sent it at step {other.step} is not the one rank {owner} "
               f"accounts for: rank {owner} sent it another average, or rank {receiver} "
               f"drifted and reports another; either may be wrong")
        if self.rank in (receiver, owner):
            self._evidence(other.step, AVG_DISAGREE,
                           owner if self.rank == receiver else receiver, 1.0, why)
        else:
            log.warning("rank %d: %s (the two report it as a dispute)", self.rank, why)

    def _other_norm(self, replica: int, step: int, stage: int, listed: str) -> None:
        """The odd one out of a digest is a replica whose pipeline exchanged, at `step`,
        another squared norm for `stage` than the other replicas' pipelines: its weights
        differ for the coefficient it was clipped with, not for itself. Named instead: the
        rank that sent that norm (`normtable.py`; the coordinator weighs it against that
        rank's own stage's records: an average it got disputed explains it)."""
        odd = self.dp_ranks[replica]
        sender = self.layout.rank(stage, replica)
        self._evidence(step, NORM_DIFFERS, sender, 1.0,
                       f"rank {sender} (stage {stage}) sent its pipeline a squared gradient norm "
                       f"at step {step} that the other replicas' stage {stage} did not send "
                       f"theirs; rank {odd}'s weights differ from its replicas' ({listed}) "
                       f"for the clipping that norm gave, so rank {odd} is not named")

    def _evidence(self, step: int, kind: str, suspect: int, score: float, detail: str) -> None:
        log.warning("rank %d: integrity check %s at step %d names rank %s: %s", self.rank,
                    kind, step, suspect if suspect >= 0 else "nobody (undecided)", detail)
        self.emit(IntegrityEvent(step=step, kind=kind, suspect_rank=suspect, score=score,
                                 detail=detail, rank=self.rank))
