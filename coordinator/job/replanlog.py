"""How re-plans read: the `Replan` records (coordinator/job/replan.py) as JSON and as text lines.

Kept apart from the re-planning itself so that `coordinator status` and `coordinator report`
render them without loading the scheduler (numpy); status, history and report share it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from google.protobuf import json_format

from protos.dtfm.v1 import coordinator_pb2


def replans_to_json(replans: Iterable[coordinator_pb2.Replan]) -> list[dict[str, Any]]:
    """Every field, defaults included, so a reader need not know which are optional."""
    return [json_format.MessageToDict(r, preserving_proto_field_name=True,
                                      always_print_fields_with_no_presence=True,
                                      unquote_int64_if_possible=True)
            for r in replans]


def _link(c: dict[str, Any]) -> str:
    return (f"{c['src']}->{c['dst']} {c['delay_ms_before']:.0f}->{c['delay_ms_after']:.0f} ms, "
            f"{c['gbps_before'] * 1e3:.1f}->{c['gbps_after'] * 1e3:.1f} Mbit/s")


def replans_to_text(replans: list[dict[str, Any]], last: int = 5) -> list[str]:
    """Indented lines: per re-plan its trigger, what changed, the weighing and the outcome."""
    lines = [f"  {len(replans)} re-plan(s) weighed"] if replans else []
    for r in replans[-last:]:
        when = time.strftime("%H:%M:%S", time.localtime(r["at_unix_s"]))
        lines.append(f"    {when} step {r['at_step']}: {r['decision'] or 'weighing'} "
                     f"({r['outcome'] or 'measuring'}): {r['trigger']}")
        for c in r["links"][:4]:
            lines.append(f"      link {_link(c)}")
        if len(r["links"]) > 4:
            lines.append(f"      ... {len(r['links']) - 4} more links changed")
        for d in r["devices"]:
            lines.append(f"      device {d['agent']}: compute {d['compute_s_before']:.2f} -> "
                         f"{d['compute_s_after']:.2f} s/step")
        if r["predicted_stay_s"]:
            lines.append(f"      predicted {r['predicted_stay_s']:.2f} s/step staying, "
                         f"{r['predicted_new_s']:.2f} s re-planned; gain {r['gain_s']:.0f} s, "
                         f"cost {r['cost_s']:.0f} s; {r['why']}")
        elif r["why"]:
            lines.append(f"      {r['why']}")
        if r["outcome"] == "moved":
            after = (f"{r['step_after_s']:.2f} s/step after" if r["step_after_s"]
                     else "not settled yet")
            lines.append(f"      moved {r['grid_before']} -> {r['grid_after']}: stalled "
                         f"{r['stalled_s']:.0f} s, {after} (was {r['step_drifted_s']:.2f})")
    return lines
