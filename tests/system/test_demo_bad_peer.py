"""`coordinator demo --bad-peer avg_zero` (issue 43, items 2 and 9): one of three agents,
owner of a third of every gradient, sends back an all-zero average of its shard from step 8
on; the demo shows it caught by the two receivers, excluded, the job rolled back to a
checkpoint before the attack and finishing on the honest two, and says so. The mode is the
averaged shard's, end to end through the real daemons: a bad contributor's gradients (x10)
are shown end to end by tests/system/test_bad_peer_excluded.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.commands.demo_badpeer import CHECKPOINT_EVERY, ONSET
from coordinator.integrity.corroborate import CONFIRMING
from coordinator.integrity.rollback import newest_before

STEPS = 20


@pytest.mark.timeout(600)
def test_demo_bad_peer_shows_the_agent_caught_excluded_and_rolled_back(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "coordinator", "demo", "--bad-peer", "avg_zero", "--steps",
         str(STEPS),
         "--json", "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=560)
    assert out.returncode == 0, out.stderr[-3000:]
    updates = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert updates[-1]["state"] == "done" and updates[-1]["step"] == STEPS, updates[-1]
    bad = updates[-1]["summary"]["bad_peer"]
    assert bad["agent"] == (tmp_path / "agent-2" / "agent-id").read_text().strip()
    assert bad["excluded"] and bad["others_excluded"] == [], bad
    assert ONSET <= bad["proven_from_step"] <= ONSET + 10, bad  # caught within 10 steps
    assert bad["evidence"] and {e["kind"] for e in bad["evidence"]} <= CONFIRMING, bad
    assert len({e["reporter"] for e in bad["evidence"]}) >= 2, bad  # two honest agents
    rollback = bad["rollback"]
    assert rollback["layout_before"] == "1x3" and rollback["layout_after"] == "1x2", rollback
    # from the newest checkpoint before the first step proven bad: the known-good floor kept
    # it (a fast job's evidence lags its steps, and this one's folder is shared), not step 0
    assert rollback["resumed_step"] == newest_before(bad["proven_from_step"], CHECKPOINT_EVERY
                                                     ) > 0, bad
    assert f"demo: bad peer {bad['agent']}: avg_zero from step {ONSET}" in out.stderr
    assert "nobody honest was excluded" in out.stderr


def test_demo_bad_peer_refuses_what_cannot_show_it() -> None:
    for flags, says in ((["--replicas", "2", "--agents", "2"], "--replicas 3 or more"),
                        (["--steps", "10"], "--steps over 18")):
        out = subprocess.run([sys.executable, "-m", "coordinator", "demo", "--bad-peer", *flags],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and says in out.stderr, out.stderr
