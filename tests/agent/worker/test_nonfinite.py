"""Whose fault a NaN or infinity in the data-parallel exchange is (agent/worker/nonfinite.py):
a peer's, named, where this replica's own copy was finite; this replica's own (`config`, as
before) where it was not. The decision and the screen's bookkeeping, in-process."""

from __future__ import annotations

import math

import torch

from agent.worker import errors
from agent.worker.badpeer import attack
from agent.worker.nonfinite import (
    AVERAGE,
    COPY,
    OWN_AVERAGE,
    Blame,
    NonFinitePeerValue,
    OwnAverageNotFinite,
    Screen,
    blame,
    failure,
    finite,
    verdict,
)
from coordinator.integrity.corroborate import CONFIRMING
from dtfm.core import causes

NAN = torch.tensor([1.0, math.nan, 2.0])
INF = torch.tensor([1.0, 2.0, -math.inf])
OK = torch.tensor([1.0, 2.0, 3.0])


def test_verdict_blames_a_peer_only_where_my_own_copy_was_finite() -> None:
    copy, average = Blame(2, COPY, 1, math.nan), Blame(1, AVERAGE, 3, math.inf)
    assert verdict(True, []) is None
    assert verdict(True, [copy]) == copy
    assert verdict(True, [average]) == average
    assert verdict(True, [average, copy]) == copy  # a bad input explains a bad mean
    assert verdict(False, [copy, average]) is None  # my own NaN: my NonFiniteLoss says so
    own = Blame(0, OWN_AVERAGE, 1, math.nan)
    assert verdict(True, [average, own]) == own and verdict(True, [own, copy]) == copy


def test_finite_is_exact_where_a_sum_of_finite_values_overflows() -> None:
    big = torch.full((4,), 3e38)  # finite, but their fp32 sum is not
    half = torch.tensor([1.0, math.inf], dtype=torch.float16)
    assert finite([OK, NAN, INF, big, half, big.half()]) == [True, False, False, True, False,
                                                             False]
    assert finite([torch.full((8,), 6e4, dtype=torch.float16)]) == [True]  # summed in fp32
    assert finite([]) == []


def test_the_owner_averages_a_peers_non_finite_copy_as_zeros_and_names_it() -> None:
    screen = Screen()
    used = screen.copies([OK, NAN, INF], me=0)
    assert all(bool(torch.isfinite(c).all()) for c in used)
    assert torch.equal(used[0], OK) and not used[1].any() and not used[2].any()
    assert screen.own_finite()
    found = screen.close()
    assert found is not None and (found.peer, found.kind, found.count) == (1, COPY, 1)
    assert math.isnan(found.value)
    assert screen.close() is None  # the next step starts clean


def test_the_owners_own_non_finite_copy_blames_nobody() -> None:
    screen = Screen()
    used = screen.copies([OK, NAN, INF], me=1)
    assert all(bool(torch.isfinite(c).all()) for c in used)  # sends back a finite mean
    assert not screen.own_finite()
    assert screen.close() is None
    assert screen.own_finite()


def test_a_receiver_names_the_owner_of_a_non_finite_average() -> None:
    screen = Screen()
    screen.sent(OK)
    screen.averages([(0, OK), (1, OK), (2, INF)], me=1)
    found = screen.close()
    assert found is not None and (found.peer, found.kind, found.count) == (2, AVERAGE, 1)
    assert found.value == -math.inf


def test_a_receiver_whose_own_sent_copy_was_not_finite_blames_nobody() -> None:
    screen = Screen()
    screen.sent(OK)
    screen.sent(NAN)
    screen.averages([(2, INF)], me=0)
    assert screen.close() is None


def test_an_owners_non_finite_mean_of_finite_copies_is_its_own_fault() -> None:
    """A faulty device (or the rehearsal's `avg_nan`) makes its own mean non-finite: it says
    so itself, as `internal` (retried), which outranks its receivers' reports against it."""
    screen = Screen()
    screen.copies([OK, OK, OK], me=2)
    screen.averages([(0, OK), (2, NAN)], me=2)
    found = screen.close()
    assert found is not None and (found.peer, found.kind) == (2, OWN_AVERAGE)
    e = failure(6, [4, 5, 6], found, 3)
    assert isinstance(e, OwnAverageNotFinite) and "rank 6: its own average" in str(e)
    assert errors.classify(e, errors.TRAIN) == errors.INTERNAL
    assert causes.outranks(errors.INTERNAL, errors.BAD_VALUE)
    assert not isinstance(e, NonFinitePeerValue)  # no evidence against itself


def test_the_failure_names_the_sender_as_a_bad_value_with_evidence() -> None:
    e = failure(4, [4, 5, 6], blame(COPY, 2, NAN), 7)
    assert isinstance(e, NonFinitePeerValue)
    assert e.sender == 6 and errors.classify(e, errors.TRAIN) == errors.BAD_VALUE
    assert "rank 4: rank 6 (replica 2 of data-parallel ranks [4, 5, 6]) sent a copy of " \
           "the gradient shard this rank owns holding 1 non-finite value(s), the first nan " \
           "at step 7" in str(e)
    assert "not this job's configuration" in str(e)
    ev = e.evidence
    assert (ev.step, ev.kind, ev.suspect_rank, ev.rank, ev.score) == (7, COPY, 6, 4, 1.0)
    # named over the peer errors it causes, under the sender's own config error
    assert causes.outranks(errors.BAD_VALUE, errors.PEER)
    assert causes.outranks(errors.CONFIG, errors.BAD_VALUE)
    # no honest owner sends a non-finite mean, no honest replica a non-finite copy of a
    # finite model: two reporters confirm the fault
    assert {COPY, AVERAGE} <= CONFIRMING


def test_the_nan_attack_puts_a_nan_and_an_infinity_in_an_honest_copy() -> None:
    t = torch.arange(1.0, 6.0)
    out = attack("nan", t)
    assert math.isnan(out[0]) and out[-1] == math.inf and torch.equal(out[1:-1], t[1:-1])
    assert torch.equal(t, torch.arange(1.0, 6.0))  # the sender's own copy is untouched
    assert math.isnan(attack("nan", torch.ones(1))[0])
