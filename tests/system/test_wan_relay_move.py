"""A direct path that breaks for good mid-epoch moves its pair to the relay, and the epoch
trains to the end (issue 40: "a pair whose direct path fails at run time moves to the relay
for the rest of the epoch, both ends agreed, and says so").

Three stages, one agent each; agent 1 sits behind a NAT and dials the others; the
coordinator's relay, on host 0, reaches all. Once training runs, the emulated link
between the two agents' hosts is cut both ways (a route gone, a firewall rule that drops):
every packet is dropped, nothing answers with a reset. Each end finds the connection dead
when its data or its keepalive probes go unanswered for `sockio.UNACKED_S`; the dialer's
new direct connections fail, the listener's wait for one ends after `resume.FALLBACK_S`, and
both move the pair to the relay, where they resume. The waits of the step in flight sit the
move out (`work.TransportWork`) instead of failing it; agent 2, which waits on the pair's
traffic in each step (the pipeline, the gradient norm's exchange) without being one of its
ends, waits at least `resume.MEND_S` on the dtfm transport. Before, the pair failed and the
coordinator rolled the job back to its last checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dtfm.wan import WanEmulator
from dtfm.wan.cluster import measurement_wan
from tests.system.midepoch import links, run_changing, trained_in_one_epoch, worker_logs

AVAILABLE, WHY = WanEmulator.available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"no WAN emulator here: {WHY}")

CUT_AT = 5


@pytest.mark.timeout(400)
def test_a_direct_path_cut_mid_epoch_moves_the_pair_to_the_relay(tmp_path: Path) -> None:
    with measurement_wan(links(3, 10), links(3, 100), nat=[1]) as wan:
        # agent 0 <-> agent 1 (hosts 1 and 2), every packet dropped from now on
        status, cut = run_changing(wan, tmp_path, CUT_AT, lambda: wan.live.set_link(
            1, 2, cut=True, both_ways=True), agents=3)
    assert cut, "the job never reached the step to cut at"
    trained_in_one_epoch(status)
    workers = worker_logs(tmp_path, 3)
    for i in (0, 1):
        assert "the pair moves to the relay" in workers[i], workers[i][-3000:]
        assert "resumed the connection with rank" in workers[i], workers[i][-3000:]
