"""`DTFM_FAULT=*:STEP:MODE` strikes whatever rank the worker gets (agent/worker/fault.py): set
on one agent, its workers are the bad ones wherever the coordinator places them."""

from __future__ import annotations

import pytest

from agent.worker.fault import ENV_FAULT, Fault


def test_any_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_FAULT, "*:8:avg_scale")
    f = Fault.from_env()
    assert f is not None
    for rank in (0, 5):
        assert f.contributions(rank) is None  # an averages mode: not the contributions
        attack = f.contributions(rank, averages=True)
        assert attack is not None and attack.mode == "scale" and attack.onset == 8
    monkeypatch.setenv(ENV_FAULT, "*:8:direct")
    with pytest.raises(ValueError, match="RANK must be 1 or more"):
        Fault.from_env()
