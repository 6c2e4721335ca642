"""A NAT that forgets its mappings mid-epoch does not end the epoch (issue 40): the pipeline's
connection through it is made again and resumed, and the job trains to the end without a
recovery.

Agent 0 is public; agent 1 sits behind a NAT and dials agent 0 for their pipeline pair (2
stages x 1 replica, rank order). Once training runs, the emulated NAT drops every mapping, as
a home router that reboots or a carrier NAT short of table does. Agent 1's next packet (a
frame, or a keepalive probe once its receive has waited 10 s: `sockio.keep_alive`) leaves
from a new public port; agent 0 knows only the old one and answers with a reset, and agent
0's own frames to the old port die at the NAT. Agent 1's worker dials again; agent 0's takes
the new connection in place of the old; the two exchange frame counts and each resends what
the other had not read (`agent/worker/transport/resume.py`). Before, the reset failed the
pair and the coordinator rolled the job back to its last checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dtfm.wan import WanEmulator
from dtfm.wan.cluster import measurement_wan
from tests.system.midepoch import links, run_changing, trained_in_one_epoch, worker_logs

AVAILABLE, WHY = WanEmulator.available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"no WAN emulator here: {WHY}")

FORGET_AT = 5


@pytest.mark.timeout(400)
def test_a_nat_that_forgets_its_mappings_mid_epoch_costs_no_recovery(tmp_path: Path) -> None:
    with measurement_wan(links(2, 10), links(2, 100), nat=[1]) as wan:
        status, forgot = run_changing(wan, tmp_path, FORGET_AT, wan.forget_nat)
    assert forgot and forgot[0] >= 1, forgot  # the data-plane flow's mapping, at least
    trained_in_one_epoch(status)
    workers = worker_logs(tmp_path)
    assert "dialling again" in workers[1], workers[1][-3000:]
    assert "connected again" in workers[0], workers[0][-3000:]  # the new one replaced the old
