"""`ProgressLine`: redrawn in place on a terminal, a line per event or every N s in a file."""

from __future__ import annotations

import io

from dtfm.core.words import counted, stages_x_replicas
from dtfm.progressline import ProgressLine


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_into_a_file_a_line_per_event_or_every_ten_seconds_not_per_update() -> None:
    out = io.StringIO()
    line = ProgressLine(out, every_s=10.0)
    for t in range(100):  # a demo's 100 updates, one a second, in one state
        line.show(f"[running] step {t}/100", key="running", now=float(t))
    line.show("[done] step 100/100", key="done", now=100.0)  # an event: at once
    line.finish()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0] == "[running] step 0/100" and lines[-1] == "[done] step 100/100"
    assert len(lines) == 11  # t = 0, 10, ..., 90, then done; not 101


def test_finish_writes_the_newest_line_held_back() -> None:
    out = io.StringIO()
    line = ProgressLine(out, every_s=10.0)
    line.show("step 1", now=0.0)
    line.show("step 2", now=1.0)
    line.finish()
    assert out.getvalue() == "step 1\nstep 2\n"


def test_on_a_terminal_the_line_is_redrawn_in_place() -> None:
    out = Terminal()
    line = ProgressLine(out)
    for t in range(3):
        line.show(f"step {t}", now=float(t))
    line.finish()
    assert out.getvalue() == "\rstep 0\x1b[K\rstep 1\x1b[K\rstep 2\x1b[K\n"


def test_counts_are_singular_for_one() -> None:
    assert stages_x_replicas(2, 1) == "2 stages x 1 replica"
    assert stages_x_replicas(1, 3) == "1 stage x 3 replicas"
    assert counted(1, "city", "cities") == "1 city" and counted(2, "city", "cities") == "2 cities"
