"""What a recovery learns from a pair of agents whose connection failed (issue 40).

Before this, each recovery rescheduled the same placement over the same paths, so a pair
whose connection could not hold (a firewall dropping one direction, a punched path that a NAT
closes, a relay circuit one end never reached) failed every epoch the same way until the
restart budget ran out. The job now keeps, across epochs, every pair a worker's peer error
named (the reporting rank's agent and the rank its error names: "receive from rank 6
failed"), with the path the data plane gave that pair (`path_of`: direct, dial-out, punched or
relay). A pair that fails again changes something, in this order:

1. its path: a pair that was not relayed is relayed (both ends at once: the coordinator writes
   the one peer table both assignments carry, coordinator/job/dataplane.py `relay_only`);
2. its placement: the two agents are planned as if their link were dead, so the search (or a
   swap) keeps them from being pipeline or data-parallel neighbours, or one is left out
   (coordinator/job/epochlinks.py `avoid_dead_links`);
3. failing those, the job fails with a message naming both agents, their addresses, and the
   port to open.

A failure that names no pair (a lost agent, a worker's own error) or a pair not seen before
changes nothing here. The memory is kept in the coordinator's state directory with the job
(`to_json`), so a restarted coordinator does not retry what already failed.
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from coordinator.daemon.registry import ALIVE, AgentRecord, Registry
from coordinator.job.dataplane import DataPlanes
from coordinator.links import failure as linkfailure
from dtfm.core.assignment import member_address
from dtfm.core.causes import PEER
from dtfm.core.workerstate import WorkerState
from protos.dtfm.v1 import coordinator_pb2

log = logging.getLogger(__name__)

DIRECT, DIAL_OUT, PUNCHED, RELAY = "direct", "dial-out", "punched", "relay"
RELAY_IT, MOVE_APART = "relay", "apart"  # what was tried for a pair, in this order
# the rank a worker's peer error names: "receive from rank 6 failed", "send to rank 3",
# "waiting for gradients ... from rank 7", "connection to rank 2 lost"
_NAMED_RANK = re.compile(r"\b(?:from|to) rank (\d+)\b")
Pair = frozenset[str]


def named_rank(error: str) -> int | None:
    """The peer rank a worker's peer error names first (None: it names none)."""
    found = _NAMED_RANK.search(error)
    return int(found.group(1)) if found else None


def failed_pairs(members: Sequence[str],
                 progress: Mapping[str, coordinator_pb2.ProgressReport]) -> set[Pair]:
    """The pairs (agent ids) whose connection the epoch's peer errors name: each worker failed
    on a peer with the agent of the rank its error names. `members`: agent ids by rank."""
    pairs = set()
    for agent_id, report in progress.items():
        if (WorkerState.from_wire(report.worker_state) is not WorkerState.FAILED
                or report.error_kind != PEER):
            continue
        peer = named_rank(report.error)
        if peer is not None and 0 <= peer < len(members) and members[peer] != agent_id:
            pairs.add(frozenset((agent_id, members[peer])))
    return pairs


@dataclass
class PairRecord:
    """One pair's failures: how many epochs failed on it, the path it last failed on, and what
    was tried (`RELAY_IT`, `MOVE_APART`)."""

    agents: list[str]
    path: str
    failures: int = 1
    tried: list[str] = field(default_factory=list)


def pair_text(pair: Pair, ranks: Mapping[str, int]) -> str:
    """'rank 1 (agent-b) <-> rank 0 (agent-a)'."""
    a, b = sorted(pair, key=lambda x: (ranks.get(x, -1), x), reverse=True)
    return " <-> ".join(f"rank {ranks[x]} ({x})" if x in ranks else x for x in (a, b))


def what_to_open(pair: Pair, records: Mapping[str, AgentRecord | None]) -> str:
    """The two agents' addresses, and what would let them connect."""
    where = []
    for agent_id in sorted(pair):
        rec = records.get(agent_id)
        if rec is None:
            where.append(f"{agent_id} (gone)")
            continue
        port = rec.data_port or rec.info.port
        where.append(f"{agent_id} at {member_address(rec.info.host, port)}")
    return (f"{' and '.join(where)} could not hold a connection directly, through a relay, "
            f"or placed apart: open inbound TCP to each one's port above from the other (its "
            f"--advertise address and --data-port), or start the coordinator's relay "
            f"(--relay-port) on a port both reach, or leave one of them out")


class FailedPairs:
    """The job's memory of failed pairs, and the changes it asks of the next epoch."""

    def __init__(self, saved: list[dict[str, Any]] | None = None) -> None:
        self.pairs: dict[Pair, PairRecord] = {}
        # what each recovery changed, to take back when a lost agent explains it (`forget`)
        self._before: dict[int, dict[Pair, PairRecord | None]] = {}
        for item in saved or []:
            rec = PairRecord(**item)
            self.pairs[frozenset(rec.agents)] = rec

    def relay_only(self) -> set[Pair]:
        """Pairs the next epochs relay."""
        return {p for p, r in self.pairs.items() if RELAY_IT in r.tried}

    def apart(self) -> set[Pair]:
        """Pairs the next epochs plan as if their link were dead."""
        return {p for p, r in self.pairs.items() if MOVE_APART in r.tried}

    def learn(self, recovery: int, failed: set[Pair], members: Sequence[str],
              path_of: Callable[[int, int], str], can_relay: bool,
              records: Mapping[str, AgentRecord | None]) -> str:
        """Take the epoch's failed pairs (`failed_pairs`); decide and log, for each that failed
        before, what the next epoch changes. `recovery`: its number, for the log; `members`:
        the failed epoch's agent ids by rank; `path_of(rank, rank)`: the path that epoch gave a
        pair; `can_relay`: whether a relay serves the job. The job's failure when nothing is
        left to change ('' otherwise)."""
        ranks = {a: k for k, a in enumerate(members)}
        give_up = []
        if recovery not in self._before:  # only the newest recovery can still be explained
            self._before = {recovery: {}}
        before = self._before[recovery]
        for pair in sorted(failed, key=sorted):
            a, b = sorted(pair, key=lambda x: ranks[x])
            path = path_of(ranks[a], ranks[b])
            rec = self.pairs.get(pair)
            before.setdefault(pair, None if rec is None else copy.deepcopy(rec))
            who = pair_text(pair, ranks)
            if rec is None:
                self.pairs[pair] = PairRecord(sorted(pair), path)
                log.info("recovery %d: %s failed on the %s path; noted (a second failure "
                         "changes its path or placement)", recovery, who, path)
                continue
            rec.failures += 1
            before, rec.path = rec.path, path
            how = (f"failed {rec.failures} times, last on the {path} path"
                   if before != path else f"failed {rec.failures} times on the {path} path")
            if path != RELAY and RELAY_IT not in rec.tried and can_relay:
                rec.tried.append(RELAY_IT)
                log.warning("recovery %d: %s %s; relaying it", recovery, who, how)
            elif MOVE_APART not in rec.tried:
                rec.tried.append(MOVE_APART)
                log.warning("recovery %d: %s %s%s; placing them apart (or leaving one out)",
                            recovery, who, how, "" if can_relay or path == RELAY
                            else " and no relay serves the job")
            else:
                tried = " and ".join({RELAY_IT: "relayed", MOVE_APART: "placed apart"}[t]
                                     for t in rec.tried)
                give_up.append(f"{who} {how}, after it was {tried}: "
                               f"{what_to_open(pair, records)}")
                log.error("recovery %d: %s", recovery, give_up[-1])
        return "; ".join(give_up)

    def forget(self, recovery: int) -> None:
        """Take back what `recovery` learnt: a lost agent explains that epoch's peer errors
        (its neighbours' connections closed because it died, the registry heard of it only
        after them), so they say nothing of the pairs they name. Counting them would relay,
        then separate, honest pairs after every churn."""
        for pair, rec in self._before.pop(recovery, {}).items():
            if rec is None:
                self.pairs.pop(pair, None)
            else:
                self.pairs[pair] = rec
            log.info("recovery %d: a lost agent explains it; %s is not counted", recovery,
                     " <-> ".join(sorted(pair)))

    def after_epoch(self, recovery: int, members: Sequence[str],
                    progress: Mapping[str, coordinator_pb2.ProgressReport],
                    dataplane: DataPlanes, registry: Registry) -> str:
        """`learn` from a failed epoch's reports (`members`: its agent ids by rank), with the
        paths and relays of `dataplane`, which relays the next epochs' `relay_only` pairs."""
        records = {a: registry.get(a) for a in members}
        if any(r is None or r.state != ALIVE for r in records.values()):
            return ""  # a member is gone: its loss explains the peer errors (`forget`)
        gave_up = self.learn(recovery, failed_pairs(members, progress), members,
                             dataplane.path_of,
                             dataplane.can_relay([r for r in records.values() if r]), records)
        dataplane.relay_only = self.relay_only()
        return gave_up

    def to_json(self) -> list[dict[str, Any]]:
        return [asdict(r) for r in self.pairs.values()]


def keep_apart(delay: Any, bandwidth: Any, failures: linkfailure.LinkFailures,
               ids: Sequence[str], apart: set[Pair]) -> tuple[Any, Any,
                                                              linkfailure.LinkFailures]:
    """The epoch's links with each pair of `apart` among `ids` priced and listed as dead, so
    the placement keeps the two from being neighbours (`epochlinks.avoid_dead_links`)."""
    here = {p for p in apart if p <= set(ids)}
    if not here:
        return delay, bandwidth, failures
    delay, bandwidth = linkfailure.priced(delay, bandwidth, ids, here)
    return delay, bandwidth, linkfailure.LinkFailures(list(failures.leave_out),
                                                      failures.dead | here, failures.reports)
