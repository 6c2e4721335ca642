"""`--outer-delay 1`: the outer step one round late, its exchange overlapping the next round.

The arithmetic is pinned in one process, with an averager that averages two replicas' copies
by hand (`outer.OuterSync` only launches, polls and collects through it); the real runs are
`agent local` jobs over gloo: a 2 x 2 job learns as the waiting one does, every replica of a
stage holds the same anchor after each sync point, the first sync point sends nothing it waits
for and the last sends two rounds' averages, and a run resumed from its flushed checkpoint
continues with the losses of an uninterrupted one (test_outer.py's resume, with the delay).
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch import nn

from agent.worker.outer import OuterSync
from dtfm.core.spec import TrainConfig
from tests.agent.worker.testlib import (
    assert_close,
    rank_events,
    run_local,
    step_events,
)


class _Pair:
    """Two replicas' averager, by hand: `launch` keeps a replica's copies, `collect` waits
    for the other replica's copies of the same exchange and writes the mean of both into the
    gradients (the replicas sync in threads of their own, `_sync`)."""

    def __init__(self) -> None:
        self.copies: dict[int, list[list[torch.Tensor]]] = {0: [], 1: []}
        self.cond = threading.Condition()

    def of(self, replica: int, model: nn.Module) -> _Half:
        return _Half(self, replica, [p for p in model.parameters()])


class _Half:
    def __init__(self, pair: _Pair, replica: int, params: list[nn.Parameter]) -> None:
        self.pair, self.replica, self.params = pair, replica, params
        self.step, self.sent_bytes, self.codec_s = 0, 0, 0.0
        self.launched = self.collected = 0

    def launch(self) -> None:
        with self.pair.cond:
            self.pair.copies[self.replica].append(
                [p.grad.clone() for p in self.params])  # type: ignore[union-attr]
            self.pair.cond.notify_all()
        self.launched += 1

    def progress(self) -> None:
        pass

    def collect(self) -> float:
        theirs = self.pair.copies[1 - self.replica]
        with self.pair.cond:
            assert self.pair.cond.wait_for(lambda: len(theirs) > self.collected, timeout=10)
        mine, other = self.pair.copies[self.replica][self.collected], theirs[self.collected]
        for p, a, b in zip(self.params, mine, other, strict=True):
            assert p.grad is not None and torch.equal(p.grad, a)  # my copy, handed back
            p.grad.copy_((a + b) / 2)
        self.collected += 1
        return 0.0

    def average_(self) -> tuple[float, list[float]]:
        self.launch()
        self.collect()
        return 0.0, []


def _replicas(delay: int) -> tuple[list[nn.Linear], list[OuterSync], list[_Half]]:
    pair = _Pair()
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(nn.Linear(3, 2))
    halves = [pair.of(r, m) for r, m in enumerate(models)]
    outers = [OuterSync(m, h, every=2, lr=0.7, momentum=0.5, delay=delay)  # type: ignore[arg-type]
              for m, h in zip(models, halves, strict=True)]
    return models, outers, halves


def _sync(outers: list[OuterSync], step: int, flush: bool = False) -> None:
    """Both replicas' sync point at once, as their processes would reach it."""
    with ThreadPoolExecutor(2) as pool:
        for done in [pool.submit(o.sync, step, flush=flush) for o in outers]:
            done.result()


def _train_round(models: list[nn.Linear], rnd: int) -> None:
    """Each replica's inner progress of one round: a step of its own, replica-dependent."""
    with torch.no_grad():
        for r, m in enumerate(models):
            for i, p in enumerate(m.parameters()):
                p.sub_(0.01 * (r + 1) * (rnd + 1) * (i + 1) * torch.ones_like(p))


def test_a_delayed_outer_step_keeps_the_anchors_equal_and_counts_each_round_once() -> None:
    models, outers, halves = _replicas(delay=1)
    start = [p.detach().clone() for p in models[0].parameters()]
    _train_round(models, 0)
    own = [[p.detach().clone() for p in m.parameters()] for m in models]
    _sync(outers, 2)
    # nothing to collect at the first sync point: the anchor waits, each replica trains on
    # from where its own round took it (the anchor minus its own pseudo-gradient)
    for m, o, kept in zip(models, outers, own, strict=True):
        assert o.pending is not None and o.pending_step == 2
        for p, a, s, k in zip(m.parameters(), o.anchor, start, kept, strict=True):
            assert torch.equal(a, s)
            assert torch.allclose(p, k, atol=1e-7)
    for rnd in (1, 2):
        _train_round(models, rnd)
        _sync(outers, 2 * (rnd + 1))
        # the previous round's average applied on both anchors: the same bits
        for a, b in zip(outers[0].anchor, outers[1].anchor, strict=True):
            assert torch.equal(a, b)
        assert [h.collected for h in halves] == [rnd, rnd]
    _train_round(models, 3)
    _sync(outers, 8, flush=True)
    # the flush collected the round in flight and averaged the last one: every replica
    # holds the anchor, nothing is in flight
    assert [h.collected for h in halves] == [4, 4]
    for m, o in zip(models, outers, strict=True):
        assert o.pending is None
        for p, a in zip(m.parameters(), o.anchor, strict=True):
            assert torch.equal(p, a)
    for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(p, q)


def test_with_the_same_progress_every_round_late_and_waiting_steps_end_on_one_model() -> None:
    """Every round moving the weights the same way on both replicas, the outer steps see the
    same averaged pseudo-gradients, one round late or at once: the flushed end is the same."""
    ends = []
    for delay in (0, 1):
        models, outers, _ = _replicas(delay)
        for rnd in range(4):
            with torch.no_grad():
                for m in models:
                    for p in m.parameters():
                        p.sub_(0.05)
            _sync(outers, 2 * (rnd + 1), flush=rnd == 3)
        ends.append([p.detach().clone() for p in models[0].parameters()])
    for a, b in zip(*ends, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_the_delay_needs_local_steps_and_is_zero_or_one() -> None:
    TrainConfig(sync_every=4, outer_delay=1).validate(2)
    TrainConfig(sync_every=0, outer_delay=1).validate(2)  # auto: the coordinator picks H
    with pytest.raises(ValueError, match="--outer-delay 1 delays the outer step of local"):
        TrainConfig(outer_delay=1).validate(2)
    with pytest.raises(ValueError, match="--outer-delay must be 0"):
        TrainConfig(sync_every=4, outer_delay=2).validate(2)
    msg = TrainConfig(sync_every=4, outer_delay=1).to_proto()
    assert TrainConfig.from_proto(msg).outer_delay == 1


COMMON = ("--model", "gpt-tiny", "--stages", "2", "--replicas", "2", "--batch", "8",
          "--micro-batches", "2", "--steps", "12", "--seed", "3", "--eval-batches", "1",
          "--timeout", "60", "--sync-every", "4")


@pytest.mark.timeout(240)
def test_a_delayed_outer_step_trains_like_the_waiting_one_and_the_anchors_agree(
        tmp_path: Path) -> None:
    waiting = run_local(*COMMON, "--workdir", str(tmp_path / "wait"))
    late = run_local(*COMMON, "--outer-delay", "1", "--workdir", str(tmp_path / "late"))
    assert waiting.rc == 0, waiting.stderr
    assert late.rc == 0, late.stderr
    # the first round is the same (nothing applied yet either way); then within a few %
    assert_close(late.losses[:4], waiting.losses[:4], 1e-6)
    assert late.losses[-1] < late.losses[0] - 0.3, late.losses
    assert_close(late.losses, waiting.losses, 0.02)
    assert late.done is not None and waiting.done is not None
    assert abs(late.done["val_loss"] - waiting.done["val_loss"]) < 0.01 * waiting.done["val_loss"]
    # the same exchanges, counted by round (one late); a step's median would say 0
    assert late.done["dp_bytes_per_step"] == waiting.done["dp_bytes_per_step"] > 0
    events = step_events(tmp_path / "late")
    for stage in (0, 1):
        a, b = events[stage], events[2 + stage]
        synced = [(x, y) for x, y in zip(a, b, strict=True) if int(str(x["step"])) % 4 == 0]
        assert len(synced) == 3
        for x, y in synced:  # the anchors: the same bits on both replicas
            assert x["param_checksum"] == y["param_checksum"], (stage, x["step"])
            assert not math.isnan(float(str(x["param_checksum"])))
        sent = [int(str(x["dp_bytes"])) for x, _ in synced]
        # step 4 only launches; step 8 collects round 1; step 12 collects round 2 and
        # averages round 3 at once (the last step flushes)
        assert sent[0] == 0 and sent[1] > 0 and sent[2] == 2 * sent[1], sent


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("fault", "kind", "bad"), [("1:2:zero", "grad_zero", 1),
                                                    ("2:4:drift", "weights", 2)])
def test_a_lying_replica_is_named_with_the_outer_step_one_round_late(
        tmp_path: Path, fault: str, kind: str, bad: int) -> None:
    """1 x 3 with H = 2 and the delay: a replica that zeroes the pseudo-gradients it sends
    into the delayed exchange is named by the owners that score them when they arrive (a poll
    or the next sync point); one whose weights drift is named by the digest, which compares
    the anchors. Nobody honest is named, and training goes on to its end."""
    work = tmp_path / "work"
    run = run_local("--model", "gpt-tiny", "--stages", "1", "--replicas", "3", "--batch", "6",
                    "--micro-batches", "2", "--steps", "10", "--seed", "3", "--eval-batches",
                    "1", "--timeout", "60", "--sync-every", "2", "--outer-delay", "1",
                    "--workdir", str(work), env={"DTFM_FAULT": fault})
    assert run.rc == 0, run.stderr
    found = [e for events in rank_events(work, "integrity").values() for e in events]
    assert [e for e in found if e["kind"] == kind], found
    assert {e["suspect_rank"] for e in found} == {bad}, found
