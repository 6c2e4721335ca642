"""What a worker reports of its pipeline links (agent/worker/linkstats.py), how the agent
carries it (agent/daemon/supervisor.py) and what the coordinator accepts
(coordinator/daemon/validate.py): the figures coordinator/integrity/linkwitness.py checks."""

from __future__ import annotations

import math

import pytest
import torch

from agent.daemon.supervisor import WorkerProgress
from agent.worker.badpeer import ACTIVATION_ATTACKS, Activations
from agent.worker.fault import Fault
from agent.worker.linkstats import LinkTally, LinkWindows
from coordinator.daemon.validate import validate_progress
from dtfm.core.events import StepEvent
from dtfm.core.limits import MAX_LINK_WINDOWS
from dtfm.core.verify import LINK_WINDOW
from protos.dtfm.v1 import coordinator_pb2


def test_a_step_tally_is_the_root_mean_square_of_every_message_per_figure() -> None:
    tally = LinkTally()
    tally.add("act_out", torch.full((2, 3), 2.0))
    tally.add("act_out", torch.zeros(2, 3))
    tally.add("grad_in", torch.full((4,), -0.5))
    act_out, act_in, grad_out, grad_in = tally.take()
    assert act_out == pytest.approx(math.sqrt(2.0))  # (6 * 4 + 6 * 0) / 12
    assert math.isnan(act_in) and math.isnan(grad_out)
    assert grad_in == pytest.approx(0.5)
    assert all(math.isnan(v) for v in tally.take())  # reset for the next step
    tally.add("act_in", torch.tensor([math.inf, 1.0]))
    assert tally.take()[1] == 1e300  # what the wire takes: finite, and far out


def test_windows_end_at_multiples_of_the_window_and_at_the_last_step() -> None:
    windows = LinkWindows()
    got = {}
    for step in range(1, 14):
        figures = [float(step), math.nan, 0.1, math.nan]
        if out := windows.add(step, figures, last=13):
            got[step] = out
    assert sorted(got) == [LINK_WINDOW, 2 * LINK_WINDOW, 13]
    assert got[5][0] == 3.0 and got[10][0] == 8.0  # medians over steps 1-5 and 6-10
    assert math.isnan(got[5][1]) and got[5][2] == pytest.approx(0.1)
    assert got[13][0] == 12.0  # the last window, shorter: steps 11-13
    windows = LinkWindows()
    assert [windows.add(s, [1.0] * 4, last=12) for s in (11, 12)] == [[], []]  # 2: too few


def test_a_run_resumed_mid_window_reports_no_window_of_too_few_steps() -> None:
    windows = LinkWindows()
    assert windows.add(9, [1.0] * 4, last=20) == [] and windows.add(10, [1.0] * 4, 20) == []
    assert windows.add(15, [1.0] * 4, 20) == []  # steps 11..14 were missed: 1 step
    got = [windows.add(s, [1.0] * 4, 20) for s in range(16, 21)]
    assert got == [[], [], [], [], [1.0] * 4]


@pytest.mark.parametrize("mode", ACTIVATION_ATTACKS)
def test_each_activation_attack_alters_only_its_direction_from_its_step(
        mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTFM_FAULT", f"3:7:{mode}")
    fault = Fault.from_env()
    assert fault is not None and fault.activations(2) is None
    att = fault.activations(3)
    assert isinstance(att, Activations)
    t = torch.randn(4, generator=torch.Generator().manual_seed(0))
    mine = "grad_out" if mode.startswith("actgrad_") else "act_out"
    other = "act_out" if mine == "grad_out" else "grad_out"
    att.step = 6
    assert torch.equal(att(mine, t), t)
    att.step = 7
    assert torch.equal(att(other, t), t)
    changed = att(mine, t)
    assert not torch.equal(changed, t)
    assert att.lies == (mode == "act_lie")


def test_the_agent_carries_its_workers_newest_windows() -> None:
    p = WorkerProgress()
    p.apply(StepEvent(step=4, step_s=0.1))  # no window ends here
    assert p.link_windows == []
    for k in range(1, MAX_LINK_WINDOWS + 3):
        p.apply(StepEvent(step=k * LINK_WINDOW, step_s=0.1, link_act_out=float(k)))
    assert len(p.link_windows) == MAX_LINK_WINDOWS
    assert p.link_windows[-1][0] == (MAX_LINK_WINDOWS + 2) * LINK_WINDOW
    assert p.link_windows[-1][1][0] == MAX_LINK_WINDOWS + 2
    assert math.isnan(p.link_windows[-1][1][1])


def _report(**window: float) -> coordinator_pb2.ProgressReport:
    figures = {"act_out": 1.0, "act_in": math.nan, "grad_out": 0.1, "grad_in": math.nan}
    return coordinator_pb2.ProgressReport(
        agent_id="a1", job_id="j", epoch=1, step=5,
        link_windows=[coordinator_pb2.LinkWindow(step=5, **{**figures, **window})])


def test_the_coordinator_refuses_impossible_link_figures_and_too_many_windows() -> None:
    assert validate_progress(_report()) is None
    assert "link_windows (step 5): act_out must be >= 0" in (
        validate_progress(_report(act_out=-1.0)) or "")
    assert "must be a finite number" in (validate_progress(_report(grad_out=math.inf)) or "")
    many = _report()
    many.link_windows.extend([many.link_windows[0]] * MAX_LINK_WINDOWS)
    assert f"the limit is {MAX_LINK_WINDOWS}" in (validate_progress(many) or "")
