from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemons import Daemons


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[Daemons]:
    """Coordinator/agent processes that are always stopped, even when the test fails."""
    d = Daemons(tmp_path)
    try:
        yield d
    finally:
        d.close()
