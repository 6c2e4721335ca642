"""How the suite shares CI's two cores among pytest-xdist's processes (pyproject's addopts:
three of them, `--dist loadfile`).

The emulated-WAN tests spend most of their time waiting on emulated delays and rates, not
computing: test_wan_replan ran 129 s of wall clock for 81 s of CPU over both cores, and
test_wan_relay_drift 97 s for 56. So they form one lane, run one after another by one process,
beside two processes that take every other file as they free up. Three processes running WAN
tests at once slowed each to about twice its time, which puts their deadlines under test
instead of the behaviour; one at a time, each runs about as fast as alone.

xdist's own `--dist loadgroup` cannot express this under pytest 9.2: it names a test's group
by rewriting the test's node id in a way pytest no longer reads, and every test then runs
alone. A scheduler of xdist's file kind, whose unit of work is a file except for the lane,
is what `pytest_xdist_make_scheduler` (tests/conftest.py) hands xdist instead.
"""

from __future__ import annotations

from xdist.scheduler import LoadFileScheduling

WAN_LANE = "tests/system/test_wan_"
LANE = "the emulated-WAN lane"


def unit_of_work(nodeid: str) -> str:
    """The lane for a WAN test, else the test's file (so a module's fixtures stay in one
    process)."""
    file = nodeid.split("::", 1)[0]
    return LANE if file.startswith(WAN_LANE) else file


class LaneScheduling(LoadFileScheduling):
    """xdist's file scheduling with the WAN files as one unit of work."""

    def _split_scope(self, nodeid: str) -> str:  # xdist's extension point, as in its own kinds
        return unit_of_work(nodeid)
