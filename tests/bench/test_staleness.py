"""bench/staleness.py's replay: its variants mean what their names say (the pipelined
workers' rule itself is pinned to it by tests/agent/worker/test_delayed.py)."""

from __future__ import annotations

import pytest

from bench.staleness import Rule, replay

STEPS, BATCH, WARMUP, SEED = 6, 4, 1, 0


def losses(name: str, warmup: int = WARMUP) -> list[float]:
    return replay("gpt-tiny", Rule.parse(name), STEPS, BATCH, warmup, SEED).losses


def test_a_flush_every_step_is_flushed_training_and_the_rule_is_not() -> None:
    flushed = losses("flushed")
    assert losses("every:1") == flushed
    # every step of the warm-up flushes
    assert losses("predicted", warmup=STEPS) == losses("flushed", warmup=STEPS)
    delayed = losses("predicted")
    # through the first step after the warm-up it trains what flushed training does; from
    # the next on, a step in flight
    assert delayed[:WARMUP + 1] == flushed[:WARMUP + 1]
    assert all(abs(a - b) > 1e-6 for a, b in zip(delayed[WARMUP + 1:], flushed[WARMUP + 1:],
                                                  strict=True))
    plain = losses("plain")  # the prediction moves the copy
    assert all(abs(a - b) > 1e-6 for a, b in zip(plain[WARMUP + 1:], delayed[WARMUP + 1:],
                                                  strict=True))


def test_variant_names_parse_or_say_what_they_accept() -> None:
    assert Rule.parse("flushed") == Rule(delayed=False)
    assert Rule.parse("plain") == Rule(predict=0.0)
    assert Rule.parse("predicted:0.5@0.8") == Rule(predict=0.5, beta1=0.8)
    assert Rule.parse("dc:1e5") == Rule(compensate=1e5)
    assert Rule.parse("every:4") == Rule(flush_every=4)
    for bad in ("dc", "every:0", "every:1.5", "flushed:2", "predicted:x", "nope",
                "predicted@1.0"):
        with pytest.raises(SystemExit, match="variant|unknown"):
            Rule.parse(bad)
