"""Which of an epoch's failures to act on: the root cause, not the first report to arrive.

When one worker fails, its neighbours fail a moment later with a `peer` error ("Connection
closed by peer"), and whichever agent heartbeats first is heard first. Acting on that first
report hid the real cause: a worker that failed on its own input (`config`: a missing tensor, a
refused checkpoint) showed as its neighbour's gloo error and started a needless recovery before
the real error failed the job; a lost agent showed as a survivor's gloo error. So:

- causes are ranked (`dtfm.core.causes`, the order `agent local` uses too): a configuration
  error over a lost agent, over a worker's own failure (`internal`), over a peer's impossible
  value (`bad_value`: the report names the sender), over failing to join (`rendezvous`), over
  a peer's failure (`peer`), which others explain; a report replaces the job's failure only
  when it ranks higher;
- a failure that others may explain (`bad_value`, `peer`, `rendezvous`) is acted on only
  after a heartbeat interval and a margin (`hold_s`), so every member's report of the same
  fault has arrived;
- an agent found lost after the recovery began, among the members that failed, becomes the
  recovery's reason (`lost_reason`): the registry notices a silent agent only after its
  liveness timeout, long after its neighbours' errors arrived.
"""

from __future__ import annotations

from dtfm.core.causes import CAUSES, EXPLAINED_BY_OTHERS, LOST, outranks, rank

__all__ = ["CAUSES", "LOST", "hold_s", "lost_reason", "outranks", "rank"]

HOLD_MARGIN_S = 1.0  # on top of a heartbeat interval: the report's way to the coordinator


def hold_s(kind: str, since: float, now: float, heartbeat_interval_s: float) -> float:
    """How much longer to wait for other members' reports before acting on a failure of
    `kind` first seen at `since` (0: act now)."""
    if kind not in EXPLAINED_BY_OTHERS:
        return 0.0
    return max(0.0, since + heartbeat_interval_s + HOLD_MARGIN_S - now)


def lost_reason(lost: list[str], seen_first: str = "") -> str:
    """The failure a lost member makes, with the error its loss caused where one came first."""
    why = f"lost agent(s) {', '.join(lost)}"
    return f"{why} (seen first as: {seen_first})" if seen_first else why
