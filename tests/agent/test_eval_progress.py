"""A worker's eval events (`--eval-every`) reach the agent's heartbeat: the event round-trips
through the progress file's line format, and the supervisor keeps the newest real one."""

from __future__ import annotations

import math

import pytest

from agent.daemon.supervisor import WorkerProgress
from dtfm.core.events import EvalEvent, encode_event, parse_event
from dtfm.core.limits import MAX_VALIDATIONS
from dtfm.core.spec import TrainConfig


def test_an_eval_event_round_trips_and_an_older_reader_skips_it() -> None:
    event = EvalEvent(step=6, val_loss=3.25, rank=2)
    line = encode_event(event)
    assert line.startswith('{"event": "eval"') and parse_event(line) == event
    assert parse_event('{"event": "eval", "step": "x", "val_loss": 2}') == EvalEvent(
        step=0, val_loss=2.0)


def test_the_heartbeat_carries_the_newest_validations() -> None:
    p = WorkerProgress()
    assert p.validations == []
    p.apply(EvalEvent(step=4, val_loss=4.5))
    p.apply(EvalEvent(step=8, val_loss=math.nan))  # nothing to show
    p.apply(EvalEvent(step=8, val_loss=math.inf))
    assert p.validations == [(4, 4.5)]
    for step in range(5, 5 + MAX_VALIDATIONS):
        p.apply(EvalEvent(step=step, val_loss=4.0))
    assert len(p.validations) == MAX_VALIDATIONS and p.validations[0] == (5, 4.0)
    assert p.validations[-1] == (4 + MAX_VALIDATIONS, 4.0)


def test_eval_every_without_eval_batches_is_refused_naming_both_flags() -> None:
    TrainConfig(eval_every=5).validate()
    TrainConfig(eval_batches=0).validate()  # no evaluation at all: fine
    with pytest.raises(ValueError, match="--eval-every 5 evaluates nothing with "
                                         "--eval-batches 0"):
        TrainConfig(eval_every=5, eval_batches=0).validate()
