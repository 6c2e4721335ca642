"""The registry of agents: who joined, who is alive, and the queue of commands for each.

Liveness is the coordinator's judgement alone: an agent is alive while its heartbeats arrive
within the liveness timeout, lost once they stop (a crash, a partition) or when the job finds
it unreachable (`mark_lost`), and left when it said goodbye (`leave`). Every change of an
agent's state happens here, so each one is logged with its reason and fires the same
callbacks, whoever noticed it. Rows lost or left for longer than `evict_after_s` are dropped,
so churn does not grow the registry forever. The registry is touched only from the event
loop, so it needs no locks.

Each agent id is bound to a secret issued at its first Join: a second process under the same
id (a copied state directory, a cloned VM, someone forging reports) cannot take over the row,
its command stream or its reports. Secrets live in memory only; after a coordinator restart the
first Join of an id wins and gets a fresh secret (the agents re-join within their backoff).
A secret goes out only in its own agent's Welcome: a report's copy is dropped once checked
(`heartbeat` keeps none), since every token holder reads the rows through GetStatus.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from coordinator.daemon.pace import HeartbeatPace
from protos.dtfm.v1 import common_pb2, coordinator_pb2

log = logging.getLogger(__name__)

ALIVE = coordinator_pb2.AGENT_STATE_ALIVE
LOST = coordinator_pb2.AGENT_STATE_LOST
LEFT = coordinator_pb2.AGENT_STATE_LEFT
# out for a confirmed integrity fault (coordinator/integrity/): never alive again until an
# operator admits it, never evicted (its row shows why it is out)
EXCLUDED = coordinator_pb2.AGENT_STATE_EXCLUDED
STATE_NAMES = {ALIVE: "alive", LOST: "lost", LEFT: "left", EXCLUDED: "excluded"}


@dataclass
class AgentRecord:
    info: common_pb2.AgentInfo
    joined: float
    last_seen: float
    state: int = ALIVE
    progress: coordinator_pb2.ProgressReport = field(
        default_factory=coordinator_pb2.ProgressReport
    )
    commands: asyncio.Queue[coordinator_pb2.Command] = field(default_factory=asyncio.Queue)
    stream_generation: int = 0
    secret: str = field(default_factory=lambda: secrets.token_hex(32))
    why: str = ""  # why it is lost or left (for the log line when it comes back)
    # whether peers can dial it back (coordinator/links/reachability.py keeps it current)
    reach: common_pb2.ReachStatus = field(default_factory=common_pb2.ReachStatus)
    # why its advertised data port is not handed to peers ("": it is): another agent
    # answered there (coordinator/links/dataport.py); cleared by a re-join, which checks again
    data_port_refused: str = ""
    # why its relay is offered no more ("": it is): a frame it forwarded failed its MAC
    # (coordinator/links/relaytrust.py); a re-join does not clear it
    relay_distrusted: str = ""
    # the registry's deaf seconds (`Registry.deafened`) when it was last seen: those that
    # pass after it do not count as its silence
    deaf_mark: float = 0.0

    def proves(self, secret: str) -> bool:
        """Whether `secret` is this agent's (constant time, so it cannot be guessed bytewise)."""
        return hmac.compare_digest(self.secret.encode(), secret.encode())

    @property
    def agent_id(self) -> str:
        return self.info.agent_id

    @property
    def data_port(self) -> int:
        """The data port peers may be told to dial: the advertised one, 0 once refused."""
        return 0 if self.data_port_refused else self.info.data_port

    @property
    def address(self) -> str:
        host = self.info.host
        return f"[{host}]:{self.info.port}" if ":" in host else f"{host}:{self.info.port}"

    def to_proto(self) -> coordinator_pb2.AgentStatus:
        return coordinator_pb2.AgentStatus(
            info=self.info,
            state=self.state,  # type: ignore[arg-type]
            last_seen_unix_s=self.last_seen,
            joined_unix_s=self.joined,
            progress=self.progress,
            reach=self.reach,
            relay_distrusted=self.relay_distrusted,
        )


class IdentityError(Exception):
    """A Join or report under an agent id without that id's secret."""


def clash_message(agent_id: str) -> str:
    """What to tell a process that uses an id some other agent already proved."""
    return (f"a second agent uses the id {agent_id!r}, and this one lacks that id's secret "
            "(a copy of a state directory, or a cloned VM?): delete the agent-id and "
            "agent-secret files in this agent's --state-dir so it gets its own id")


class Registry:
    """Agents by id, in join order."""

    def __init__(
        self,
        liveness_timeout_s: float,
        clock: Callable[[], float] = time.time,
        on_change: Callable[[], None] | None = None,
        evict_after_s: float = 600.0,
        on_lost: Callable[[list[AgentRecord]], None] | None = None,
        heartbeat_interval_s: float = 1.0,
        heartbeat_budget: float = 0.0,
    ) -> None:
        """`on_change` fires on every change of the agent set or an agent's state; `on_lost`
        with the agents newly lost, whether by silence (`sweep`) or by `mark_lost`.
        `heartbeat_interval_s`: how often agents report (the welcome tells them), so how old
        the newest report of a live agent can be; `heartbeat_budget`: heartbeats a second
        past which that interval stretches (`pace.HeartbeatPace`; 0: never)."""
        self.pace = HeartbeatPace(heartbeat_interval_s, liveness_timeout_s, heartbeat_budget)
        self.evict_after_s = evict_after_s
        self._clock = clock
        self._agents: dict[str, AgentRecord] = {}
        self._seq = 0
        self._on_change = on_change or (lambda: None)
        self._on_lost = on_lost or (lambda lost: None)
        self._deaf_s = 0.0  # seconds the coordinator could not take in heartbeats, in all

    def __len__(self) -> int:
        return len(self._agents)

    @property
    def heartbeat_interval_s(self) -> float:
        """How often each agent reports now (`pace.HeartbeatPace`: it stretches with their
        number past `heartbeat_budget`)."""
        return self.pace.interval(len(self._agents))

    @property
    def liveness_timeout_s(self) -> float:
        """Seconds of silence before an agent is lost, at the interval agents report now."""
        return self.pace.liveness(len(self._agents))

    def now(self) -> float:
        """The registry's clock, the one `AgentRecord.last_seen` is read on."""
        return self._clock()

    def get(self, agent_id: str) -> AgentRecord | None:
        return self._agents.get(agent_id)

    def all(self) -> list[AgentRecord]:
        return list(self._agents.values())

    def alive(self) -> list[AgentRecord]:
        return [a for a in self._agents.values() if a.state == ALIVE]

    def join(self, info: common_pb2.AgentInfo, secret: str = "") -> AgentRecord:
        """Register or re-register an agent; a re-join replaces (ends) the old command stream.

        An id this registry knows needs its secret (IdentityError otherwise), whatever the row's
        state: a lost agent's id is not free for the taking until it is evicted. Every Join gets
        a fresh secret, so of two processes sharing one state directory (secret and all) the
        one that joined last holds the id and the other is refused at its next report or Join,
        instead of both stealing the stream from each other forever.
        """
        now = self._clock()
        rec = self._agents.get(info.agent_id)
        if rec is not None and not rec.proves(secret):
            raise IdentityError(clash_message(info.agent_id))
        if rec is None:
            rec = AgentRecord(info=info, joined=now, last_seen=now, deaf_mark=self._deaf_s)
            self._agents[info.agent_id] = rec
            log.info("agent %s joined from %s (%s)", info.agent_id, rec.address, info.device.kind)
        else:
            if rec.state != ALIVE:
                log.info("agent %s is back (was %s: %s)", info.agent_id,
                         STATE_NAMES[rec.state], rec.why)
            rec.info = info
            rec.last_seen, rec.deaf_mark = now, self._deaf_s
            rec.state = ALIVE
            rec.why = ""
            rec.data_port_refused = ""
            rec.commands.put_nowait(None)  # type: ignore[arg-type]  # ends the old stream
            rec.commands = asyncio.Queue()
            rec.secret = secrets.token_hex(32)
        rec.stream_generation += 1
        self._on_change()
        return rec

    def authenticate(self, agent_id: str, secret: str) -> AgentRecord | None:
        """The agent's row if `secret` proves `agent_id`; None when the id is unknown.

        Raises IdentityError when the id is known and the secret is not its own.
        """
        rec = self._agents.get(agent_id)
        if rec is not None and not rec.proves(secret):
            raise IdentityError(
                f"agent {agent_id!r}: wrong or missing agent_secret; only the agent that "
                "joined under this id may report for it. If two agents share this id (a copied "
                "state directory, a cloned VM), delete agent-id and agent-secret in one's "
                "--state-dir")
        return rec

    def heartbeat(self, report: coordinator_pb2.ProgressReport) -> AgentRecord | None:
        """Take a heartbeat: the agent is alive and this is its progress.

        A heartbeat from an agent marked lost or left brings it back (it answers, so it is
        alive), and says so with the reason it was out: an agent the job left out as
        unreachable comes back this way within one heartbeat interval.
        """
        rec = self._agents.get(report.agent_id)
        if rec is None:
            return None
        rec.last_seen, rec.deaf_mark = self._clock(), self._deaf_s
        if rec.state == EXCLUDED:
            return rec  # its word no longer counts; the server refuses it
        said = {t.setting: t.wanted for t in rec.progress.tuning}
        new = [t for t in report.tuning if said.get(t.setting) != t.wanted]
        if new:
            log.warning("agent %s's host is not tuned for long links (coordinator status "
                        "shows the fix): %s", rec.agent_id,
                        "; ".join(f"{t.setting} is {t.current}, wants {t.wanted}" for t in new))
        report.ClearField("agent_secret")  # proven by now; never kept, so never shown
        rec.progress = report
        if rec.state != ALIVE:
            log.log(logging.WARNING if rec.state == LOST else logging.INFO,
                    "agent %s is alive again: it sends heartbeats after it was marked %s (%s)",
                    rec.agent_id, STATE_NAMES[rec.state], rec.why)
            rec.state = ALIVE
            rec.why = ""
            self._on_change()
        return rec

    def leave(self, agent_id: str, reason: str) -> AgentRecord | None:
        """The agent said goodbye: mark it left (not lost). None when the id is unknown."""
        rec = self._agents.get(agent_id)
        if rec is None:
            return None
        rec.last_seen = self._clock()
        if rec.state != LEFT:
            rec.state = LEFT
            rec.why = reason or "said goodbye"
            log.info("agent %s left: %s", agent_id, rec.why)
            self._on_change()
        return rec

    def mark_lost(self, agent_id: str, reason: str) -> AgentRecord | None:
        """Mark a live agent lost for `reason` (e.g. its peers cannot reach it), exactly as if
        its heartbeats had stopped: logged, `on_change` and `on_lost` fire. Returns the record,
        or None when the id is unknown or the agent is not alive (nothing changes)."""
        rec = self._agents.get(agent_id)
        if rec is None or rec.state != ALIVE:
            return None
        self._lose(rec, reason)
        self._on_change()
        self._on_lost([rec])
        return rec

    def exclude(self, agent_id: str, reason: str) -> AgentRecord | None:
        """Mark an agent excluded for `reason` (coordinator/integrity/exclusion.py): a live one
        is lost to its job exactly as if its heartbeats had stopped (`on_lost` fires), and it
        is never alive again until `admit`. None when the id is unknown."""
        rec = self._agents.get(agent_id)
        if rec is None or rec.state == EXCLUDED:
            return rec
        was_alive = rec.state == ALIVE
        rec.state, rec.why = EXCLUDED, reason
        log.warning("agent %s excluded: %s", agent_id, reason)
        rec.commands.put_nowait(None)  # type: ignore[arg-type]  # ends its command stream
        self._on_change()
        if was_alive:
            self._on_lost([rec])
        return rec

    def admit(self, agent_id: str) -> None:
        """An operator admitted an excluded agent: its row counts as lost until it joins."""
        rec = self._agents.get(agent_id)
        if rec is not None and rec.state == EXCLUDED:
            rec.state, rec.why = LOST, "admitted by an operator; waiting for it to join"
            self._on_change()

    def _lose(self, rec: AgentRecord, reason: str) -> None:
        rec.state = LOST
        rec.why = reason
        log.warning("agent %s lost: %s", rec.agent_id, reason)

    def deafened(self, seconds: float) -> None:
        """The coordinator could not take in heartbeats for `seconds` (its event loop was
        held: a long status answer, a starved core). Heartbeats sent meanwhile wait in its
        sockets, unread, and the sweep that runs first after such a stall would take every
        agent for silent (1,000 simulated agents were all marked lost after a 7 s stall), so
        that time does not count as anyone's silence."""
        self._deaf_s += max(0.0, seconds)

    def silence_s(self, rec: AgentRecord, now: float) -> float:
        """How long `rec` has been silent while the coordinator could hear it."""
        return now - rec.last_seen - (self._deaf_s - rec.deaf_mark)

    def sweep(self) -> list[AgentRecord]:
        """Mark agents silent past the timeout as lost; return those newly lost."""
        now, timeout = self._clock(), self.liveness_timeout_s
        lost = []
        for rec in self._agents.values():
            if rec.state == ALIVE and (silent := self.silence_s(rec, now)) > timeout:
                deaf = now - rec.last_seen - silent
                self._lose(rec, f"no heartbeat for {silent:.1f} s (timeout {timeout:.1f} s"
                                + (f"; not counting {deaf:.1f} s the coordinator was held)"
                                   if deaf >= 0.05 else ")"))
                lost.append(rec)
        if lost:
            self._on_change()
            self._on_lost(lost)
        return lost

    def evict(self) -> list[str]:
        """Drop agents lost or left for longer than `evict_after_s`; return their ids."""
        now = self._clock()
        gone = [rec for rec in self._agents.values()
                if rec.state not in (ALIVE, EXCLUDED)
                and now - rec.last_seen > self.evict_after_s]
        for rec in gone:
            del self._agents[rec.agent_id]
            rec.commands.put_nowait(None)  # type: ignore[arg-type]  # ends a stale stream
            log.info("agent %s evicted: %s for %.0f s (--evict-after %.0f s)", rec.agent_id,
                     STATE_NAMES[rec.state], now - rec.last_seen, self.evict_after_s)
        if gone:
            self._on_change()
        return [rec.agent_id for rec in gone]

    def status_rows(self, limit: int) -> tuple[list[AgentRecord], int]:
        """At most `limit` agents for a status answer, in join order, and how many were left out.

        Alive agents come first; the rest of the room goes to the most recently seen.
        """
        rows = list(self._agents.values())
        if len(rows) <= limit:
            return rows, 0
        ranked = sorted(rows, key=lambda r: (r.state != ALIVE, -r.last_seen))[:limit]
        keep = {r.agent_id for r in ranked}
        return [r for r in rows if r.agent_id in keep], len(rows) - limit

    def send(self, agent_id: str, command: coordinator_pb2.Command) -> None:
        rec = self._agents[agent_id]
        self._seq += 1
        command.seq = self._seq
        rec.commands.put_nowait(command)
