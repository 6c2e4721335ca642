"""`agent local` names the worker whose failure explains the others, not the first to exit.

With two or more stages, a worker that refuses its own input (a `config` error) closes its
connections, and its pipeline neighbour fails a moment later with "Connection closed by peer".
Both may have exited by the time the launcher looks; it used to name the lowest rank, the
neighbour, hiding the real cause. Now it names the most telling kind (`dtfm.core.causes`) and
waits a moment for reports when every failure so far is one another's usually explains.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from agent.commands.local import Proc, dp_bytes_per_step, root_failure
from dtfm.core import causes
from dtfm.core.events import FAULT_EXIT_CODE
from tests.agent.worker.testlib import run_local


def proc(rank: int, kind: str, code: int = 1) -> Proc:
    worker: Any = SimpleNamespace(returncode=code)  # only the exit status is read
    return Proc(rank, worker, kind=kind)


def test_the_most_telling_failure_is_named_whatever_the_order() -> None:
    peer0, config1, rdv2 = proc(0, "peer"), proc(1, "config"), proc(2, "rendezvous")
    assert root_failure([peer0, config1, rdv2]) is config1
    assert root_failure([rdv2, peer0]) is rdv2
    assert root_failure([proc(3, "peer"), peer0]).rank == 3  # equals: the order given
    # the fault seam's victim explains everything else, whatever the others said
    victim = proc(4, "", FAULT_EXIT_CODE)
    assert root_failure([config1, victim]) is victim
    assert causes.outranks("config", "lost") and causes.outranks("lost", "internal")
    assert causes.rank("something new") == causes.rank("internal")
    with pytest.raises(ValueError):
        causes.most_telling([], lambda p: "")


@pytest.mark.timeout(240)
def test_a_worker_that_refuses_its_input_is_named_not_its_neighbour() -> None:
    run = run_local("--stages", "2", "--replicas", "1", "--batch", "2", "--micro-batches", "1",
                    "--steps", "4", "--eval-batches", "1", "--timeout", "30",
                    "--checkpoint-every", "0", timeout=200,
                    env={"DTFM_FAULT": "1:2:config"})
    assert run.rc == 1, run.stderr
    assert "worker rank 1 (stage 1, replica 0)" in run.stderr, run.stderr
    assert "fault injection: rank 1 refuses its input before step 2" in run.stderr
    errors = [json.loads(line) for line in run.stdout.splitlines() if '"error"' in line]
    assert [e["rank"] for e in errors] == [1], run.stdout


def test_bytes_per_step_count_whole_rounds_of_local_steps() -> None:
    def sent(rank: int, per_step: list[int]) -> Proc:
        p = proc(rank, "", 0)
        p.dp_bytes = per_step
        return p

    # synchronous: each rank's median step (a resumed first step sends more)
    assert dp_bytes_per_step([sent(0, [9, 4, 4, 4]), sent(1, [4, 4])]) == 8
    # H = 4: only sync points send; per step is a round's bytes over 4, the round the median
    # (the first delayed round sends nothing, the last collects two), a partial round left out
    rounds = [0, 0, 0, 0, 0, 0, 0, 40, 0, 0, 0, 80, 0, 0]
    assert dp_bytes_per_step([sent(0, rounds), sent(1, rounds)], 4) == 2 * 10
    assert dp_bytes_per_step([sent(0, [0, 0, 0])], 4) == 0  # not one whole round
