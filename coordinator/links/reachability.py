"""Finds whether each agent can be dialled at the address it advertises.

An agent behind a NAT or a firewall joins like any other (it dials out), but nobody can dial
it back: link probes to it fail, checkpoint copies from it fail, and so would every worker
connection to it. Rather than have the operator declare it, the coordinator finds out when
the agent joins: it dials the agent itself and asks up to `REACH_PEERS` live peers to dial it
too (a `DialCommand` on their Join streams, answered by `ReportDial`). Every dialer that got
through or failed counts; a peer that never answered says nothing. The verdict (everywhere,
some peers only: one site's LAN, nowhere) is kept on the agent's registry row, shown by
`coordinator status` and pushed to the agent, which logs it. A newcomer also dials earlier
agents that were checked by fewer peers (the first agent of a cluster had nobody but the
coordinator), so the verdicts firm up as agents arrive.

Agents are told apart by id only: a dial counts only when the answer comes from the id that
was meant (`dtfm.net.reach.dial`), since agents behind different NATs often advertise the same
private address. An agent started with `--reachable yes|no` is not dialled: the operator's
word is the verdict. Its data port is checked either way where peers may be told to dial it
and this dial-back does not cover it (coordinator/links/dataport.py): one another agent
answers at is not used.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from dataclasses import dataclass

from coordinator.daemon.registry import AgentRecord, Registry
from coordinator.links import dataport
from dtfm import rpc
from dtfm.net import reach
from protos.dtfm.v1 import common_pb2, coordinator_pb2

log = logging.getLogger(__name__)

REACH_PEERS = 2  # peers asked to dial each newcomer (besides the coordinator)
BACKFILL = 4  # earlier agents a newcomer dials, at most, where fewer peers checked them
REPORT_SLACK_S = 2.0  # a peer's report may come this long after its dial's own timeout


@dataclass
class _Pending:
    """A dial a peer was asked for: which agent, at which of its Joins."""

    target: str
    generation: int
    future: asyncio.Future[str]


class ReachChecker:
    def __init__(self, registry: Registry, security: rpc.Security,
                 dial_timeout_s: float = reach.DIAL_TIMEOUT_S, peers: int = REACH_PEERS) -> None:
        self.registry = registry
        self.security = security
        self.dial_timeout_s = dial_timeout_s
        self.peers = peers
        self._pending: dict[tuple[str, str], _Pending] = {}  # (round, dialer) -> what it dials
        self._rounds = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()
        # agent id -> what may still change its verdict: its Join's own check, and the dials
        # of it that later newcomers were asked for (`_backfill`)
        self._checking: dict[str, list[asyncio.Task[None]]] = {}

    def on_join(self, rec: AgentRecord) -> None:
        """A (re-)join: forget the old verdict (the address may be new) and check afresh."""
        override = rec.info.reachable
        ports = ([self._spawn(self._check_data_port(rec, rec.stream_generation))]
                 if dataport.needs_check(rec) else [])
        if override != common_pb2.REACH_OVERRIDE_AUTO:
            self._checking[rec.agent_id] = ports  # the operator's word: no dial-back
            self._settle(rec, rec.stream_generation, reach.overridden(rec.address, override))
            return
        rec.reach = common_pb2.ReachStatus(address=rec.address,
                                           summary=f"checking whether peers can dial "
                                                   f"{rec.address}")
        self._checking[rec.agent_id] = [self._spawn(self.check(rec, rec.stream_generation)),
                                        *ports]
        newcomer = rec.agent_id
        behind = [a for a in self.registry.alive()
                  if a.agent_id != newcomer and a.info.reachable == common_pb2.REACH_OVERRIDE_AUTO
                  and sum(d.dialer != reach.COORDINATOR for d in a.reach.dials) < self.peers]
        for earlier in behind[:BACKFILL]:
            task = self._spawn(self._backfill(earlier, earlier.stream_generation, newcomer))
            self._checking.setdefault(earlier.agent_id, []).append(task)

    @property
    def longest_check_s(self) -> float:
        """How long one check can take: its dials end at their timeout, a peer's report may
        come `REPORT_SLACK_S` after its own (`_ask`)."""
        return self.dial_timeout_s + REPORT_SLACK_S

    def checking(self, agent_ids: list[str]) -> list[str]:
        """Those of `agent_ids` whose verdict may still change: their own dial-back has not
        settled, or a newcomer is still dialling them. The latter matters as much: the first
        agent of a NAT'd site is "nowhere" until its neighbour joins and gets through, and an
        epoch planned in between relays a pair that could talk directly."""
        return [a for a in agent_ids if self._open(a)]

    async def settled(self, agent_ids: list[str], timeout_s: float) -> list[str]:
        """Wait up to `timeout_s` for the checks of `agent_ids` to settle; those still
        pending then (none unless a check overran its own bound)."""
        tasks = [t for a in agent_ids for t in self._open(a)]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        return self.checking(agent_ids)

    def _open(self, agent_id: str) -> list[asyncio.Task[None]]:
        """The checks of `agent_id` still running (the finished ones are forgotten)."""
        tasks = [t for t in self._checking.get(agent_id, []) if not t.done()]
        if tasks:
            self._checking[agent_id] = tasks
        else:
            self._checking.pop(agent_id, None)
        return tasks

    async def check(self, rec: AgentRecord, generation: int) -> None:
        """Dial `rec` from here and from up to `self.peers` peers; settle the verdict."""
        address, target = rec.address, rec.agent_id
        others = [a for a in self.registry.alive() if a.agent_id != target]
        random.shuffle(others)  # reachable peers first: their view is the wide one
        others.sort(key=lambda a: a.reach.verdict != reach.EVERYWHERE)
        dialers = [a.agent_id for a in others[:self.peers]]
        answers = await asyncio.gather(
            reach.dial(address, target, self.security, self.dial_timeout_s),
            *(self._ask(d, rec, generation) for d in dialers))
        dials = [reach.result(reach.COORDINATOR, answers[0])]
        dials += [reach.result(d, a) for d, a in zip(dialers, answers[1:], strict=True)
                  if a is not None]
        if not self._current(rec, generation):
            return
        mine = {d.dialer for d in dials}  # a newcomer's backfill may have come in meanwhile
        dials += [d for d in rec.reach.dials if d.dialer not in mine]
        self._settle(rec, generation, reach.judged(address, dials))

    async def _check_data_port(self, rec: AgentRecord, generation: int) -> None:
        """Dial `rec`'s own data port (`dataport.check`); refuse it where another agent
        answers there, and say so on its reachability line."""
        why = await dataport.check(rec, self.security, self.dial_timeout_s)
        if why and self._current(rec, generation) and dataport.refuse(rec, why):
            self._settle(rec, generation, rec.reach)

    async def _backfill(self, rec: AgentRecord, generation: int, dialer: str) -> None:
        """One more peer's dial of an agent checked by too few: add it to the verdict."""
        answer = await self._ask(dialer, rec, generation)
        if answer is None or not self._current(rec, generation):
            return
        dials = [d for d in rec.reach.dials if d.dialer != dialer]
        dials.append(reach.result(dialer, answer))
        if not any(d.dialer == reach.COORDINATOR for d in dials):
            rec.reach.dials.append(dials[-1])  # its own check still runs, and will merge this
            return
        self._settle(rec, generation, reach.judged(rec.address, dials))

    async def _ask(self, dialer: str, rec: AgentRecord, generation: int) -> str | None:
        """Have `dialer` dial `rec`: "" when it got through, why not otherwise, None when the
        dialer did not answer (it left, or predates DialCommand): no evidence either way."""
        round_id = f"r{next(self._rounds)}"
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._pending[(round_id, dialer)] = _Pending(rec.agent_id, generation, future)
        command = coordinator_pb2.Command(dial=coordinator_pb2.DialCommand(
            round_id=round_id, timeout_s=self.dial_timeout_s,
            peer=coordinator_pb2.PeerTarget(agent_id=rec.agent_id, address=rec.address)))
        try:
            self.registry.send(dialer, command)
            return await asyncio.wait_for(future, self.dial_timeout_s + REPORT_SLACK_S)
        except (KeyError, TimeoutError):
            return None
        finally:
            self._pending.pop((round_id, dialer), None)

    def on_report(self, report: coordinator_pb2.DialReport) -> str | None:
        """Take a peer's dial result (its secret already checked); or say why it is refused."""
        pending = self._pending.get((report.round_id, report.agent_id))
        if pending is None or pending.future.done():
            return f"no dial {report.round_id!r} is waiting for {report.agent_id}'s answer"
        if report.peer_id != pending.target:
            return (f"dial {report.round_id!r} asked {report.agent_id} to dial "
                    f"{pending.target}, not {report.peer_id}")
        pending.future.set_result("" if report.ok else (report.error or "failed (no reason)"))
        return None

    def _current(self, rec: AgentRecord, generation: int) -> bool:
        """Whether `rec` is still the row of the Join this check was for."""
        return self.registry.get(rec.agent_id) is rec and rec.stream_generation == generation

    def _settle(self, rec: AgentRecord, generation: int, status: common_pb2.ReachStatus) -> None:
        """Keep the verdict on the row, log a change, and tell the agent."""
        if not self._current(rec, generation):
            return  # it re-joined meanwhile: that Join's own check decides
        before = rec.reach.verdict
        if rec.data_port_refused and rec.data_port_refused not in status.summary:
            status.summary += f"; {rec.data_port_refused}"
        rec.reach = status
        if status.verdict != before:
            level = logging.WARNING if status.verdict == reach.NOWHERE else logging.INFO
            log.log(level, "agent %s: %s", rec.agent_id, status.summary)
        try:
            self.registry.send(rec.agent_id, coordinator_pb2.Command(reach=status))
        except KeyError:
            pass

    def _spawn(self, coro: object) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def unreachable(registry: Registry) -> list[AgentRecord]:
    """Agents nobody can dial (by the checks, or by the operator's --reachable no)."""
    return [a for a in registry.all() if a.reach.verdict == reach.NOWHERE]
