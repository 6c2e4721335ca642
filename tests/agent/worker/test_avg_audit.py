"""The replicas' exact audit of the owners' averaged shards (agent/worker/avgaudit.py, issue
43 item 2): an owner that alters its average, lies about its inputs or sends different
averages is named by every replica's judgement of the same figures; a contributor that
reports other figures than it sent is named; an honest exchange, a bad contributor's copy
included, names nobody; one dispute names nobody."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from agent.worker.avgaudit import SHARE_MIN_ENTRIES, AverageAudit, judge_exchange, width
from agent.worker.badpeer import attack

BUCKETS, N = 3, 999  # a shard of 999 / R values per bucket (padded to equal shards)

# (owner, receiver, average) -> what that receiver gets
Send = Callable[[int, int, torch.Tensor], torch.Tensor]


def exchange(r: int, seed: int, *,
             copies_sent: Callable[[int, int, torch.Tensor], torch.Tensor]
             = lambda k, i, c: c, average: Callable[[int, torch.Tensor], torch.Tensor]
             = lambda k, a: a, send: Send = lambda k, j, a: a,
             account: Callable[[int, int, torch.Tensor], torch.Tensor] = lambda k, i, c: c,
             reports: Callable[[int, int, torch.Tensor, torch.Tensor], torch.Tensor]
             = lambda k, j, sent, grad: sent, steps: int = 1, shares: bool = True
             ) -> list[list[float]]:
    """One sharded exchange as `GradAverager` runs it, each replica's audit fed by its seams;
    the replicas' rows. `copies_sent(k, i, c)`: what replica i sends owner k instead of
    its copy c;
    `average(k, a)`: what owner k sends instead of its mean a; `send(k, j, a)`: what
    receiver j gets of it; `account(k, i, c)`: the copy owner k's audit is told it got;
    `reports(k, j, sent, grad)`: the copy of k's shard contributor j's audit is told it
    sent (its gradient, which for its own shard is the copy its audit sees). `steps`
    exchanges of fresh gradients, one digest's worth."""
    g = torch.Generator().manual_seed(seed)
    audits = [AverageAudit(r, j, shares=shares) for j in range(r)]
    n = -(-N // r)
    for step in range(1, steps + 1):
        one_exchange(r, n, g, audits, copies_sent, average, send, account, reports)
        for a in audits:
            a.close_step(step)
    return [a.row() for a in audits]


def one_exchange(r: int, n: int, g: torch.Generator, audits: list[AverageAudit],
                 copies_sent: Callable[[int, int, torch.Tensor], torch.Tensor],
                 average: Callable[[int, torch.Tensor], torch.Tensor], send: Send,
                 account: Callable[[int, int, torch.Tensor], torch.Tensor],
                 reports: Callable[[int, int, torch.Tensor, torch.Tensor], torch.Tensor]
                 ) -> None:
    """Every owner's shard of `BUCKETS` buckets averaged and sent back, the audits fed."""
    for b in range(BUCKETS):
        grads = [torch.randn(N, generator=g) for _ in range(r)]
        padded = [torch.cat([x, torch.zeros(n * r - N)]) for x in grads]
        for k in range(r):
            truth = [p[k * n:(k + 1) * n] for p in padded]
            copies = [copies_sent(k, i, c) for i, c in enumerate(truth)]
            audits[k].hold(b, [account(k, i, c) for i, c in enumerate(copies)])
            mean = copies[0].clone()
            for c in copies[1:]:
                mean.add_(c)
            mean.div_(r)
            sent = average(k, mean)
            end = min(n, N - k * n)
            for j in range(r):
                got = send(k, j, sent)[:end]
                audits[j].add(b, k, got, reports(k, j, copies[j], truth[j])[:end])


def named(rows: list[list[float]]) -> list[set[tuple[int, str]]]:
    """What each replica's judgement of the same rows names: (replica, kind)."""
    r = len(rows)
    return [{(f.replica, f.kind) for _, f in AverageAudit(r, j).judge(rows)} for j in range(r)]


@pytest.mark.parametrize("r", [2, 3, 4])
def test_an_honest_exchange_names_nobody_a_bad_copy_among_its_inputs_included(r: int) -> None:
    assert all(len(row) == width(r) for row in exchange(r, 0))
    assert named(exchange(r, 0)) == [set()] * r
    # a x10 contributor moves the mean, not the identity: no owner is named
    bad = exchange(r, 1, copies_sent=lambda k, i, c: c * 10 if i == 1 else c)
    assert named(bad) == [set()] * r


@pytest.mark.parametrize("mode", ["scale", "noise", "flip"])
@pytest.mark.parametrize("r", [2, 3, 4])
def test_an_owner_that_alters_its_average_is_named_by_every_replica(mode: str, r: int) -> None:
    gen = torch.Generator().manual_seed(5)
    rows = exchange(r, 2, average=lambda k, a: attack(mode, a, gen=gen) if k == 1 else a)
    assert named(rows) == [{(1, "avg_mismatch")}] * r


def test_an_owner_that_makes_its_account_add_up_by_lying_about_two_inputs_is_named() -> None:
    """It sends x10 and tells its audit every copy was 10x: the sum adds up, and both
    contributors' own figures contradict it."""
    rows = exchange(3, 3, average=lambda k, a: a * 10 if k == 0 else a,
                    account=lambda k, i, c: c * 10 if k == 0 else c,
                    reports=lambda k, j, sent, grad: sent * 10 if k == j == 0 else sent)
    assert named(rows) == [{(0, "avg_inputs")}] * 3


def test_a_contributor_whose_figures_contradict_every_owner_is_named() -> None:
    """It sends its copies x10 to the other owners and reports its true gradient's figures
    (what the rehearsal's bad contributor does): every owner's account of it disagrees."""
    rows = exchange(3, 4, copies_sent=lambda k, i, c: c * 10 if i == 2 != k else c,
                    reports=lambda k, j, sent, grad: grad)
    assert named(rows) == [{(2, "avg_claims")}] * 3


def test_an_owner_that_sends_different_averages_is_named() -> None:
    rows = exchange(4, 5, send=lambda k, j, a: a * 2 if k == 3 and j in (0, 1) else a)
    assert named(rows) == [{(3, "avg_equivocal")}] * 4


def test_one_dispute_names_nobody() -> None:
    """Owner 0 and contributor 1 disagree about 1's copy: either may be lying."""
    rows = exchange(3, 6, account=lambda k, i, c: c * 1.5 if k == 0 and i == 1 else c)
    found = named(rows)
    # owner 0's account no longer adds up to its average: that is its own inconsistency
    assert found == [{(0, "avg_mismatch")}] * 3
    figs = [row[1:] for row in exchange(3, 6)]
    figs[1][0] *= 1.5  # contributor 1's dot with owner 0's average, alone, is off
    assert judge_exchange(3, figs) == []


def test_figures_of_different_steps_or_lengths_are_not_judged() -> None:
    rows = exchange(3, 7)
    rows[2] = [2.0, *rows[2][1:]]
    assert named(rows) == [set()] * 3
    assert AverageAudit(3, 0).judge([rows[0], rows[1][:-1], rows[2]]) == []


def hide_in_own_copy(k: int, scale: float) -> dict[str, Callable[..., torch.Tensor]]:
    """Owner k sends `scale` x its mean and tells its audit that its own copy was whatever
    makes the account add up: R x what it sent less the others' copies. Its figures then
    agree with every contributor's, and the sum identity holds."""
    held: dict[str, torch.Tensor] = {}

    def average(owner: int, a: torch.Tensor) -> torch.Tensor:
        return a * scale if owner == k else a

    def account(owner: int, i: int, c: torch.Tensor) -> torch.Tensor:
        if owner == k:
            held["sum"] = c.clone() if i == 0 else held["sum"] + c
            held.setdefault("others", torch.zeros_like(c))
            if i != k:
                held["others"] = held["others"] + c
        return c

    def reports(owner: int, j: int, sent: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        if owner == j == k:  # its own copy of its own shard: the invented one
            return scale * held.pop("sum")[: sent.numel()] - held.pop("others")[: sent.numel()]
        return sent
    return {"average": average, "account": account, "reports": reports}


@pytest.mark.parametrize("r", [3, 4])
def test_an_owner_that_hides_what_it_added_in_its_own_copy_is_named_by_its_share(r: int) -> None:
    """Its account adds up and agrees with every contributor: only its own copy's share,
    as the contributors' figures imply it, gives it away, over a digest's exchanges."""
    rows = exchange(r, 8, steps=10, **hide_in_own_copy(1, 10.0))
    assert named(rows) == [{(1, "avg_share")}] * r
    steps = {at for at, _ in AverageAudit(r, 0).judge(rows)}
    assert steps == {1}  # the first exchange of the window: the rollback's bound
    assert named(exchange(r, 8, steps=SHARE_MIN_ENTRIES - 1, **hide_in_own_copy(1, 10.0))) \
        == [set()] * r  # too few exchanges to judge a median
    # with local steps (pseudo-gradients, one exchange a digest) it is not judged
    assert all(not AverageAudit(r, j, shares=False).judge(rows) for j in range(r))


def test_shares_are_not_judged_at_r2() -> None:
    """Two copies' shares are each other's complement: their spread is the pair's norm
    ratio's, up to 19x in an honest fine-tune (docs/architecture.md, "R = 2")."""
    assert named(exchange(2, 8, steps=10, **hide_in_own_copy(1, 10.0))) == [set()] * 2


def test_honest_owners_shares_stay_low_over_a_digest_a_bad_input_included() -> None:
    assert named(exchange(3, 9, steps=10)) == [set()] * 3
    bad = exchange(3, 9, steps=10, copies_sent=lambda k, i, c: c * 10 if i == 2 != k else c)
    assert named(bad) == [set()] * 3  # a x10 input lowers the honest owners' shares
    # ... and where its sender owns a shard, its own x10 copy weighs in its own mean
    bad = exchange(3, 9, steps=10, copies_sent=lambda k, i, c: c * 10 if i == 2 else c)
    assert named(bad) == [{(2, "avg_share")}] * 3


def test_a_receiver_that_lies_about_the_average_it_got_cannot_move_an_owners_share() -> None:
    """Replica 2 reports another |a_0|^2 for owner 0's average (so its dot is not disputed)
    and a dot that would put owner 0's implied share past the threshold: nobody is named,
    owner 0 least of all (one receiver against one owner names nobody)."""
    rows = exchange(3, 10, steps=10)
    w = width(3)
    for e in range(10):
        rows[2][e * w + 1 + 2] *= 1.5  # its q for owner 0
        rows[2][e * w + 1 + 0] -= 5.0 * rows[0][e * w + 1 + 2]  # its d for owner 0
    assert named(rows) == [set()] * 3


def receivers(rows: list[list[float]]) -> list[list[tuple[int, int, int, bool]]]:
    """Each replica's judgement's receivers of another average: (step, owner, receiver,
    whether the owner is named)."""
    out = []
    for j in range(len(rows)):
        audit = AverageAudit(len(rows), j)
        audit.judge(rows)
        out.append([(o.step, o.owner, o.receiver, o.named) for o in audit.receivers])
    return out


def test_a_receiver_of_another_average_is_kept_for_the_digest_named_or_not() -> None:
    """Owner 2 sends receiver 0 ten times its average at both exchanges: one receiver
    against one owner names nobody, but every replica's judgement keeps the pair (the
    weights digest will find 0 odd, replicacheck.py). Sent to two receivers, the owner is
    named (`avg_equivocal`) and the pairs say so."""
    one = exchange(3, 11, steps=2, send=lambda k, j, a: a * 10 if (k, j) == (2, 0) else a)
    assert named(one) == [set()] * 3
    assert receivers(one) == [[(1, 2, 0, False), (2, 2, 0, False)]] * 3
    two = exchange(4, 12, send=lambda k, j, a: a * 10 if k == 3 and j in (0, 1) else a)
    assert named(two) == [{(3, "avg_equivocal")}] * 4
    assert receivers(two) == [[(1, 3, 0, True), (1, 3, 1, True)]] * 4
    assert receivers(exchange(3, 13, steps=3)) == [[]] * 3  # honest: none


def test_a_receiver_disputing_its_owner_alone_is_kept_too() -> None:
    """Receiver 1's dot with owner 0's average is off, its |a_0|^2 not: the same one-on-one
    dispute (it got another average of the same norm, or lies about its copy)."""
    rows = exchange(3, 14, reports=lambda k, j, sent, grad: sent * 1.5 if (k, j) == (0, 1)
                    else sent)
    assert named(rows) == [set()] * 3
    assert receivers(rows) == [[(1, 0, 1, False)]] * 3


def test_a_receiver_the_figures_name_is_not_kept() -> None:
    """Contributor 2 sends x10 copies and reports the copies it computed: two owners' accounts
    dispute it (`avg_claims`), and its own dispute with each owner is no owner's doing."""
    rows = exchange(3, 15, copies_sent=lambda k, i, c: c * 10 if i == 2 else c,
                    reports=lambda k, j, sent, grad: grad)
    assert (2, "avg_claims") in named(rows)[0]
    assert all(o[2] != 2 for got in receivers(rows) for o in got), receivers(rows)


def test_the_receivers_check_hands_the_audit_the_dots_it_took() -> None:
    """`AverageChecker.add` returns |a|^2, <a, mine>, |mine|^2, which `AverageAudit.add`
    reads instead of taking them again: the same figures either way."""
    from agent.worker.avgcheck import AverageChecker
    g = torch.Generator().manual_seed(16)
    average, mine = torch.randn(300, generator=g), torch.randn(300, generator=g)
    dots = AverageChecker(3, 0).add(1, average, mine)
    assert (dots.average_sq, dots.mine, dots.mine_sq) == pytest.approx(
        (float(average @ average), float(average @ mine), float(mine @ mine)), rel=1e-6)
    given, taken = AverageAudit(3, 0), AverageAudit(3, 0)
    given.add(0, 1, average, mine, dots)
    taken.add(0, 1, average, mine)
    given.close_step(1)
    taken.close_step(1)
    assert given.row() == pytest.approx(taken.row(), rel=1e-6)
