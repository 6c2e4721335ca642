"""`--pipeline-delay 1` trains exactly its rule, whatever the layout.

The rule (agent/worker/delayed.py, PipeDream-2BW with SpecTrain's weight prediction): step
t's forwards and backwards run on the weights after step t - 2 moved by AdamW's step t - 1 as
the moments predict it (that update is still in flight), its clipped gradient updates the
newest weights, and a flush (here: the learning rate's warm-up steps and the last step)
applies every pending update. A reference
written here from that rule alone, in one process, with the worker's model, data and
optimizer as a library, must give the losses the pipelined workers report; real processes
over gloo (`agent local`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.staleness import Rule, replay
from coordinator.scheduler.memory import micro_batches_held
from dtfm.core.layout import (
    delayed_run_ops,
    delayed_step_ops,
    delayed_warmup,
    one_f_one_b,
    pipeline_ops,
)
from dtfm.core.spec import TrainConfig
from tests.agent.worker.testlib import assert_close, run_local

STEPS, BATCH, SEED, WARMUP = 16, 8, 3, 3  # the warm-up's steps flush
COMMON = ("--model", "gpt-tiny", "--batch", str(BATCH), "--steps", str(STEPS), "--seed",
          str(SEED), "--eval-batches", "1", "--timeout", "60", "--schedule", "1f1b",
          "--warmup-steps", str(WARMUP))
REL = 1e-4


def test_steps_that_do_not_flush_are_one_pipeline_over_their_micro_batches() -> None:
    for stages in (2, 4, 6):
        for stage in range(stages):
            for micro in (1, 2, 3, 4, 8):
                warmup = delayed_warmup(stage, stages, micro)
                assert delayed_run_ops(stage, stages, micro, 3) == one_f_one_b(warmup,
                                                                               3 * micro)
                # 2BW's two copies: the step before's last backward precedes the step
                # after next's first forward
                assert warmup <= micro
                if stage + 1 < stages:  # a gradient comes from a slot already run
                    assert warmup >= delayed_warmup(stage + 1, stages, micro) + 1 \
                        or warmup == micro == min(micro, stages - stage - 1)
    # deeper than 1F1B where the micro-batches allow (more in flight across the links'
    # delays); 1F1B's own where they do not
    assert [delayed_warmup(s, 4, 8) for s in range(4)] == [8, 7, 6, 0]
    assert [delayed_warmup(s, 4, 2) for s in range(4)] == [2, 2, 1, 0]
    ops = delayed_step_ops(1, 4, 2, carried=False, flush=True)
    assert [(op, i) for op, _, i in ops] == pipeline_ops("1f1b", 1, 4, 2)


def _reference_2bw(micro: int) -> list[float]:
    """gpt-tiny trained by the rule, in one process: each step's loss (bench/staleness.py's
    replay, written from the rule alone with the worker's model, data and optimizer)."""
    return replay("gpt-tiny", Rule(), STEPS, BATCH, WARMUP, SEED, micro=micro).losses


@pytest.mark.timeout(240)
@pytest.mark.parametrize("micro", [4, 2], ids=["4-micro", "2-micro-fewer-than-warm-up"])
def test_a_pipeline_that_does_not_flush_trains_the_2bw_rule(micro: int,
                                                            tmp_path: Path) -> None:
    run = run_local(*COMMON, "--stages", "4", "--replicas", "1", "--micro-batches",
                    str(micro), "--pipeline-delay", "1", "--workdir", str(tmp_path))
    assert run.rc == 0, run.stderr
    assert [s["step"] for s in run.steps] == list(range(1, STEPS + 1))
    reference = _reference_2bw(micro)
    assert_close(run.losses, reference, REL)
    # what each stage held at once, as the memory model counts it
    for rank in range(4):
        events = [json.loads(line) for line in
                  (tmp_path / f"rank{rank}.progress.jsonl").read_text().splitlines()]
        peak = max(e["stored_peak"] for e in events if e.get("event") == "step")
        assert peak == micro_batches_held("1f1b", rank, 4, micro, pipeline_delay=1), rank
    # the check can fail: flushing every step trains other weights from step 2 on
    flushed = run_local(*COMMON, "--stages", "4", "--replicas", "1", "--micro-batches",
                        str(micro))
    assert flushed.rc == 0, flushed.stderr
    # the warm-up flushes every step: the same as flushed training until it ends
    assert_close(flushed.losses[:WARMUP + 1], reference[:WARMUP + 1], REL)
    apart = max(abs(a - b) / b for a, b in zip(flushed.losses[WARMUP + 1:],
                                               reference[WARMUP + 1:], strict=True))
    assert apart > 20 * REL, apart
    assert run.losses[-1] < run.losses[0] - 0.3  # it learns


@pytest.mark.timeout(240)
def test_with_local_steps_the_pipeline_flushes_at_sync_points_and_any_layout_agrees() -> None:
    """2 replicas, H = 4, the outer step one round late: the same losses on 1 and 3 stages."""
    flags = (*COMMON, "--replicas", "2", "--micro-batches", "2", "--sync-every", "4",
             "--outer-delay", "1", "--pipeline-delay", "1")
    one = run_local(*flags, "--stages", "1")
    three = run_local(*flags, "--stages", "3")
    assert one.rc == 0 and three.rc == 0, one.stderr + three.stderr
    assert [s["step"] for s in three.steps] == list(range(1, STEPS + 1))
    assert_close(three.losses, one.losses, REL)
    assert three.done is not None and one.done is not None
    assert three.done["val_loss"] == pytest.approx(one.done["val_loss"], rel=REL)


@pytest.mark.parametrize("flags, says", [
    (("--schedule", "gpipe"), "--schedule 1f1b"),
    (("--replicas", "2"), "--sync-every H"),
    (("--pipeline-delay", "2"), "must be 0"),
])
def test_a_pipeline_delay_the_worker_cannot_train_is_refused(flags: tuple[str, ...],
                                                             says: str) -> None:
    args: dict[str, object] = {"schedule": "1f1b", "pipeline_delay": 1}
    replicas = 1
    for name, value in zip(flags[::2], flags[1::2], strict=True):
        if name == "--replicas":
            replicas = int(value)
        else:
            args[name[2:].replace("-", "_")] = int(value) if value.isdigit() else value
    with pytest.raises(ValueError, match=says.replace("-", r"\-")):
        TrainConfig(**args).validate(replicas)  # type: ignore[arg-type]


@pytest.mark.timeout(240)
def test_both_ends_of_a_link_report_the_same_figures_without_flushes(tmp_path: Path) -> None:
    """A stage's last backward of a step comes a pass later on some stages than on others;
    the coordinator's link check compares both ends (coordinator/integrity/linkwitness.py), so
    each end tallies whole steps. Uncompressed on loopback the two ends see the same bits."""
    run = run_local(*COMMON, "--stages", "3", "--replicas", "1", "--micro-batches", "4",
                    "--pipeline-delay", "1", "--workdir", str(tmp_path))
    assert run.rc == 0, run.stderr
    figures: dict[int, dict[str, list[float]]] = {}
    for rank in range(3):
        events = [json.loads(line) for line in
                  (tmp_path / f"rank{rank}.progress.jsonl").read_text().splitlines()]
        steps = [e for e in events if e.get("event") == "step"]
        assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
        figures[rank] = {k: [e[k] for e in steps if e.get(k) is not None
                             and math.isfinite(e[k])]
                         for k in ("link_act_out", "link_act_in", "link_grad_out",
                                   "link_grad_in")}
    for rank in range(2):  # the link from rank to rank + 1
        sent, got = figures[rank], figures[rank + 1]
        assert len(sent["link_act_out"]) == 3, sent  # windows of 5 steps: 3 of 16 steps
        assert_close(got["link_act_in"], sent["link_act_out"], 1e-6)
        assert_close(sent["link_grad_in"], got["link_grad_out"], 1e-6)
