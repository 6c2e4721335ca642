from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemons import Daemons

# Longest first: the two pytest processes (pyproject's addopts) take a test file each as they
# free up, in this order, so the minutes-long multi-agent files start early and the short unit
# tests fill the end, instead of one process finishing a long file while the other idles.
FIRST = ("tests/system/", "tests/agent/", "tests/coordinator/")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid
        return next((i for i, top in enumerate(FIRST) if path.startswith(top)), len(FIRST))

    items.sort(key=rank)  # stable: files stay whole and in order within each group


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[Daemons]:
    """Coordinator/agent processes that are always stopped, even when the test fails."""
    d = Daemons(tmp_path)
    try:
        yield d
    finally:
        d.close()
