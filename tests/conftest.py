from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemons import Daemons
from tests.lanes import WAN_LANE, LaneScheduling

# Longest first: xdist's processes take a unit of work each as they free up, in this order
# (pyproject's --no-loadscope-reorder), so the WAN lane and the minutes-long multi-agent files
# start early and the short unit tests fill the end, instead of one process finishing a long
# file while the others idle.
FIRST = (WAN_LANE, "tests/system/", "tests/agent/", "tests/coordinator/")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid
        return next((i for i, top in enumerate(FIRST) if path.startswith(top)), len(FIRST))

    items.sort(key=rank)  # stable: files stay whole and in order within each group


@pytest.hookimpl(optionalhook=True)  # xdist's hook: absent under -p no:xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> LaneScheduling | None:
    """tests/lanes.py's scheduler where the run asks for files (`--dist loadfile`, the
    default); xdist's own for any other `--dist`."""
    return LaneScheduling(config, log) if config.getvalue("dist") == "loadfile" else None


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[Daemons]:
    """Coordinator/agent processes that are always stopped, even when the test fails."""
    d = Daemons(tmp_path)
    try:
        yield d
    finally:
        d.close()
