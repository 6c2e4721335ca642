"""The receivers' check of an averaged shard (agent/worker/avgcheck.py, issue 43 item 2):
honest means of R = 2, 3, 4 copies pass every step; each attack on the average is named;
an attack on an input (one bad copy) skews honest means, and is not blamed on their owner
when the receiver's own scoring saw the bad copy."""

from __future__ import annotations

import pytest
import torch

from agent.worker.avgcheck import SELF_EVIDENT, AverageChecker, judge
from agent.worker.badpeer import attack

SHARD = 4096


def copies(r: int, gen: torch.Generator) -> list[list[torch.Tensor]]:
    """Per owner, R replicas' heavy-tailed copies of its shard (a normal variate's 7th power:
    a few large coordinates, as a gradient's) that share a direction (the true gradient) and
    differ by their batches' noise, each owner's shard at its own scale."""
    out = []
    for k in range(r):
        true = 2 * torch.randn(SHARD, generator=gen) ** 7
        out.append([(true + torch.randn(SHARD, generator=gen) ** 7) * (k + 1)
                    for _ in range(r)])
    return out


def step(checker: AverageChecker, shards: list[list[torch.Tensor]],
         altered: dict[int, torch.Tensor] | None = None) -> list[tuple[int, str]]:
    for k, cs in enumerate(shards):
        avg = (altered or {}).get(k, sum(cs) / len(cs))
        checker.add(k, avg, None if k == checker.me else cs[checker.me])
    return [(f.replica, f.kind) for f in judge(checker.scores())]


@pytest.mark.parametrize("r", [2, 3, 4])
def test_honest_means_pass(r: int) -> None:
    gen = torch.Generator().manual_seed(r)
    checkers = [AverageChecker(r, me) for me in range(r)]
    for _ in range(12):
        shards = copies(r, gen)
        for c in checkers:
            assert step(c, shards) == []


@pytest.mark.parametrize("r", [3, 4])
@pytest.mark.parametrize("mode,kinds", [
    ("scale", {"avg_norm"}), ("flip", {"avg_cosine"}), ("noise", {"avg_noise"}),
    ("zero", {"avg_zero"}), ("stale", {"avg_stale"})])
def test_each_attack_on_the_average_names_its_owner(r: int, mode: str,
                                                    kinds: set[str]) -> None:
    """`scale` here is x20 and `noise` 3 sigma: the thresholds, not the rehearsal's strength.
    Its x10 lands at 10x the reference, under the threshold (16, over the honest 10
    measured), and is caught on the steps where an honest ratio would have been above 1.6
    (55-90 % of receiver-steps at R >= 3, bench/avgcheck.py); its 1 sigma noise is not
    caught by the receivers (docs/architecture.md, "The averaged shard")."""
    gen = torch.Generator().manual_seed(0)
    checker = AverageChecker(r, 1)  # receiver 1, owner 0 attacks from step 6
    held = None
    for _ in range(5):
        shards = copies(r, gen)
        held = sum(shards[0]) / r
        assert step(checker, shards) == []
    shards = copies(r, gen)
    mean = sum(shards[0]) / r
    bad = attack(mode, mean, held, gen)
    bad = {"scale": bad * 2, "noise": mean + 3 * (bad - mean)}.get(mode, bad)
    assert step(checker, shards, {0: bad}) == [(0, kind) for kind in kinds]


@pytest.mark.parametrize("mode", ["flip", "zero", "stale"])
def test_two_replicas_judge_what_needs_no_reference(mode: str) -> None:
    """R = 2: one other average is no reference for a norm or a shape; the cosine with my own
    copy, a zero and a replayed average still show."""
    gen = torch.Generator().manual_seed(1)
    checker, held = AverageChecker(2, 1), None
    for _ in range(4):
        shards = copies(2, gen)
        held = sum(shards[0]) / 2
        step(checker, shards)
    shards = copies(2, gen)
    found = step(checker, shards, {0: attack(mode, sum(shards[0]) / 2, held, gen)})
    assert [owner for owner, _ in found] == [0], found


def test_an_attack_that_starts_small_does_not_become_the_reference() -> None:
    """x1.8 a step, compounding: no step is 16x the one before, but only steps near the
    reference join it, so the growing average is named once it is 16x the honest one."""
    gen = torch.Generator().manual_seed(2)
    checker = AverageChecker(3, 1)
    for _ in range(4):
        step(checker, copies(3, gen))
    found: list[tuple[int, str]] = []
    for n in range(1, 8):
        shards = copies(3, gen)
        found += step(checker, shards, {0: sum(shards[0]) / 3 * 1.8 ** n})
    assert (0, "avg_norm") in found


def test_a_bad_input_is_not_blamed_on_an_honest_owner() -> None:
    """One replica's copy x10 to every owner makes every honest mean larger: a receiver whose
    own shard scoring saw the bad copy judges only what no input can cause."""
    gen = torch.Generator().manual_seed(3)
    checker = AverageChecker(3, 1)
    for _ in range(5):
        step(checker, copies(3, gen))
    shards = copies(3, gen)
    for cs in shards:
        cs[2] = cs[2] * 10
    for k, cs in enumerate(shards):
        checker.add(k, sum(cs) / 3, None if k == 1 else cs[1])
    scores = checker.scores()
    assert judge(scores, inputs_suspect=True) == []
    assert not {f.kind for f in judge(scores, statistics=False)} - SELF_EVIDENT


def test_uneven_shares_leaving_two_owners_give_no_reference() -> None:
    """Uneven shares (scheduled placement's `dp_shares`) can leave a stage of four replicas
    two owners; a receiver that owns nothing then has one other average to take a norm or a
    shape against, as at R = 2, and judges neither (an honest owner's shape read 4.1-4.6x
    there, and these honest norm ratios swing 0.2-4.3x); a zero average is still named, it
    needs no reference."""
    gen = torch.Generator().manual_seed(3)
    checker = AverageChecker(4, 3)  # receiver 3 owns no shard: owners 0 and 1 hold it all

    def two_owners(alter: str = "") -> list[tuple[int, str]]:
        shards = copies(2, gen)
        for k, cs in enumerate(shards):
            mean = sum(cs) / 2
            if k == 0 and alter == "noise":  # 3 sigma, as the test above: the threshold's
                mean = mean + 3 * (attack("noise", mean, None, gen) - mean)
            elif k == 0 and alter == "zero":
                mean = torch.zeros_like(mean)
            checker.add(k, mean, cs[0])
        return [(f.replica, f.kind) for f in judge(checker.scores())]

    for _ in range(5):
        assert two_owners() == []
    assert two_owners("noise") == []  # no reference to call it noise against
    assert two_owners("zero") == [(0, "avg_zero")]
