"""`coordinator demo --bad-peer`'s account of the rehearsal, from a status document
(coordinator/commands/demo_badpeer.py); the run itself: tests/system/test_demo_bad_peer.py."""

from __future__ import annotations

import argparse

from coordinator.commands.demo_badpeer import ONSET, bad_env, outcome, outcome_text, resolve


def status(bad_state: str) -> dict:
    exclusion = {"reason": "grad_norm: 11.9x", "step": 8, "at": 1.0, "evidence": [
        {"kind": "grad_norm", "step": 8, "reporter": "a", "detail": "", "at": 1.0,
         "confirmed": True},
        {"kind": "grad_norm", "step": 9, "reporter": "b", "detail": "", "at": 1.0,
         "confirmed": True}]} if bad_state == "excluded" else None
    return {"agents": [{"id": "a", "state": "alive", "exclusion": None},
                       {"id": "b", "state": "alive", "exclusion": None},
                       {"id": "bad", "state": bad_state, "exclusion": exclusion}],
            "job": {"recoveries": [{"reason": "excluded: grad_norm", "layout_before": "1x3",
                                    "layout_after": "1x2", "resumed_step": 4}]}}


def test_the_account_names_the_agent_the_evidence_and_the_rollback() -> None:
    o = outcome(status("excluded"), "bad", "scale")
    assert o["excluded"] and o["proven_from_step"] == 8 and o["onset_step"] == ONSET
    assert o["rollback"] == {"layout_before": "1x3", "layout_after": "1x2", "resumed_step": 4}
    text = outcome_text(o)
    assert f"bad peer bad: scale from step {ONSET}, proven bad from step 8" in text
    assert "grad_norm from a, b" in text and "rolled back to step 4" in text
    assert "nobody honest was excluded" in text


def test_a_bad_peer_not_caught_is_said_so() -> None:
    o = outcome(status("alive"), "bad", "zero")
    assert not o["excluded"] and "NOT excluded" in outcome_text(o)


def test_the_defaults_fit_and_the_bad_agent_gets_its_fault() -> None:
    args = argparse.Namespace(wan=None, model=None, agents=None, stages=None, replicas=None,
                              steps=None, batch=None, micro_batches=None)
    assert resolve(args) == "" and (args.stages, args.replicas, args.agents) == (1, 3, 3)
    assert bad_env({"X": "1"}, "drift") == {"X": "1", "DTFM_FAULT": f"*:{ONSET}:drift"}
    args.wan = "world"
    assert "--wan" in resolve(args)
