"""Which running job holds which agents: the pool of live agents split into shares.

A coordinator runs two (or more) submitted jobs side by side when the agents suffice for
both (coordinator/daemon/jobsplit.py decides how many each gets). Each running job is a
`coordinator.job.machine.Job` as before, handed an `AgentShare` in place of the registry: a
view that answers `alive()` with only the agents that job holds, and passes every other call
(`get`, `send`, `mark_lost`, `now`, ...) through to the one `Registry`. So the job's
membership, planning, recovery and growing code is unchanged and never sees, picks or
measures another job's agents.

A job holds the agents the scheduler assigned it when it started and, always, its members
(the agents its epoch runs on: an adopted job after a coordinator restart holds its
snapshot's members). A job running alone holds nothing exclusively: it sees every live agent,
as a coordinator of one job always did, so its spares, recoveries and growing back work as
before. Agents no job holds are idle spares: the oldest running job sees them too (it may
replace a lost member with one, or grow onto them), the others only their own; the next job
to start takes its share of them. The daemon starts no job while another is still picking its
agents (coordinator/daemon/jobcalls.py), so no two jobs ever pick the same idle agent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from coordinator.daemon.registry import AgentRecord, Registry
from coordinator.scheduler.placement import address_key


def by_address(records: Iterable[AgentRecord]) -> list[AgentRecord]:
    """`records` in address order (the order a network-blind launcher would use)."""
    return sorted(records, key=lambda a: address_key(a.info.host, a.info.port))


class AgentShare:
    """The registry as one running job sees it (see the module docstring)."""

    def __init__(self, pool: AgentPool, job_id: str, assigned: Iterable[str]) -> None:
        self._pool = pool
        self.registry = pool.registry
        self.job_id = job_id
        self.assigned: set[str] = set(assigned)
        self.members: Callable[[], list[str]] = list  # the job's members; bound by the pool's user
        self.why = ""  # what the scheduler decided for this job, for the log and `jobs`

    def __getattr__(self, name: str) -> Any:  # every other call goes to the registry
        return getattr(self.registry, name)

    def __len__(self) -> int:
        return len(self.registry)

    def held(self) -> set[str]:
        """The agents this job holds: assigned, and its members."""
        return self.assigned | set(self.members())

    def alone(self) -> bool:
        return len(self._pool.shares) <= 1

    def alive(self) -> list[AgentRecord]:
        """The live agents this job may use: all of them when it runs alone, else its own,
        and for the oldest running job the free ones too (its spares)."""
        if self.alone():
            return self.registry.alive()
        held = self.held()
        if next(iter(self._pool.shares.values())) is self:
            others = self._pool.held(but=self.job_id)
            return [a for a in self.registry.alive()
                    if a.agent_id in held or a.agent_id not in others]
        return [a for a in self.registry.alive() if a.agent_id in held]


class AgentPool:
    """The shares of the running jobs, by job id, in the order they started."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.shares: dict[str, AgentShare] = {}

    def share(self, job_id: str, assigned: Iterable[str] = ()) -> AgentShare:
        """A share for a job starting now (an earlier one of the same id is replaced)."""
        share = AgentShare(self, job_id, assigned)
        self.shares[job_id] = share
        return share

    def bind(self, share: AgentShare, job_id: str, members: Callable[[], list[str]]) -> None:
        """`share` is the running job `job_id`'s (its id known once the job is built: an
        adopted job takes its snapshot's), with `members` its members as they stand."""
        if self.shares.get(share.job_id) is share:
            del self.shares[share.job_id]
        share.job_id, share.members = job_id, members
        self.shares[job_id] = share

    def release(self, job_id: str) -> None:
        """The job ended: its agents are free for the next one (they keep running)."""
        self.shares.pop(job_id, None)

    def held(self, but: str = "") -> set[str]:
        """Agents some running job (other than `but`) holds."""
        return set().union(*(s.held() for j, s in self.shares.items() if j != but))

    def free(self) -> list[AgentRecord]:
        """Live agents no running job holds, in address order."""
        held = self.held()
        return by_address(a for a in self.registry.alive() if a.agent_id not in held)
