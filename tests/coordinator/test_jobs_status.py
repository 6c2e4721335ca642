"""Two jobs side by side, as an operator sees them: `coordinator status` (text and --json, from
a real `GetStatus` call), the web view's document and a real scrape of the Prometheus
endpoint each show both jobs, their states, steps and the agents each holds; neither job's
series overwrites the other's."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from prometheus_client.parser import text_string_to_metric_families

from coordinator.commands.status import status_to_json, status_to_text
from coordinator.daemon.config import CoordinatorConfig
from coordinator.daemon.jobs import Submitted
from coordinator.daemon.server import CoordinatorService
from coordinator.daemon.sidecars import start_metrics
from coordinator.web.view import View
from dtfm import rpc
from protos.dtfm.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.agent.test_checkpoint_transfer import SECURITY
from tests.coordinator.served import served, stop_driving

JOB = ["--model", "gpt-tiny", "--agents", "4", "--min-agents", "2", "--stages", "2"]


@contextlib.asynccontextmanager
async def two_jobs(config: CoordinatorConfig
                   ) -> AsyncIterator[tuple[str, CoordinatorService, Submitted, Submitted]]:
    """The real service on loopback with 6 agents joined and two queued jobs started side by
    side (the second with three times the work: 2 agents and 4); their drivers are cancelled
    after."""
    async with served(config) as (address, svc):
        for i in range(6):
            svc.registry.join(common_pb2.AgentInfo(agent_id=f"a{i}", host="127.0.0.1",
                                                   port=7000 + i))
        small = svc.queue.submit([*JOB, "--steps", "3"])
        big = svc.queue.submit([*JOB, "--steps", "9"])
        svc.start_what_fits()
        assert len(svc.runs) == 2
        try:
            yield address, svc, small, big
        finally:
            await stop_driving(svc)


def held(svc: CoordinatorService, job: Submitted) -> list[str]:
    return sorted(svc.pool.shares[job.job_id].held())


def test_status_and_its_json_show_every_running_job_with_the_agents_it_holds() -> None:
    async def main() -> None:
        async with two_jobs(CoordinatorConfig(security=SECURITY)) as (address, svc, small, big):
            assert held(svc, small) == ["a0", "a1"] and held(svc, big) == ["a2", "a3", "a4", "a5"]
            async with rpc.open_channel(address, SECURITY) as channel:
                stub = coordinator_pb2_grpc.CoordinatorStub(channel)
                status = await stub.GetStatus(coordinator_pb2.StatusRequest(), timeout=10)
                second = await stub.GetStatus(coordinator_pb2.StatusRequest(job_id=big.job_id),
                                              timeout=10)
            assert second.job.job_id == big.job_id and list(second.job.held_agents) == \
                held(svc, big)
            data = status_to_json(status)
            jobs = {j["id"]: j for j in data["jobs"]}
            assert [j["id"] for j in data["jobs"]] == [small.job_id, big.job_id]  # oldest first
            assert data["job"]["id"] == small.job_id and data["jobs_omitted"] == 0
            assert data["job"]["held_agents"] == held(svc, small)  # `job` is the first
            for job in (small, big):
                j = jobs[job.job_id]
                assert j["held_agents"] == held(svc, job) and j["model"] == "gpt-tiny"
                assert j["state"] != "idle" and j["total_steps"] == job.config.train.steps
                assert "agent(s) of 4 wanted (at least 2)" in j["share"]
            assert not status.jobs[0].HasField("export_source")  # `job` has it in full
            text = status_to_text(status)
            assert "running jobs: 2, side by side on disjoint agents" in text
            assert f"{big.job_id}: {jobs[big.job_id]['state']}  model gpt-tiny  step 0/9" \
                in text and "holds 4 agent(s): a2, a3, a4, a5" in text
            assert "holds 2 agent(s): a0, a1" in text

    asyncio.run(main())


def test_the_web_view_shows_each_running_job_and_their_states_in_its_timeline() -> None:
    async def main() -> None:
        async with two_jobs(CoordinatorConfig(security=SECURITY)) as (_, svc, small, big):
            page = View(svc.status_answer, svc.history_answer).page()
            shown = {j["id"]: j["held_agents"] for j in page["status"]["jobs"]}
            assert shown == {small.job_id: held(svc, small), big.job_id: held(svc, big)}
            said = " ".join(e["text"] for e in page["events"] if e["kind"] == "job")
            assert f"job {small.job_id} " in said and f"job {big.job_id} " in said

    asyncio.run(main())


def test_a_scrape_has_each_running_jobs_series_and_plan_under_its_own_job_id() -> None:
    async def scrape(port: int) -> str:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: test\r\n\r\n")
        reply = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        return reply.split(b"\r\n\r\n", 1)[1].decode()

    async def main() -> None:
        config = CoordinatorConfig(security=SECURITY, metrics_listen="127.0.0.1:0")
        async with two_jobs(config) as (_, svc, small, big):
            plan = common_pb2.Plan(stages=1, replicas=2, cost=1.5)  # the big job placed
            plan.grid.add(agent_ids=["a2", "a3"])
            svc.runs[big.job_id].job.plan = plan
            server = await start_metrics(svc)
            assert server is not None
            try:
                text = await scrape(server.sockets[0].getsockname()[1])
            finally:
                server.close()
        samples = [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text)
                   for s in f.samples]
        for job in (small, big):
            mine = {name: value for name, labels, value in samples
                    if labels.get("job_id") == job.job_id and "state" not in labels}
            assert mine["dtfm_job_total_steps"] == job.config.train.steps
            assert "dtfm_job_step" in mine and "dtfm_job_loss" in mine
            assert "dtfm_job_tokens_per_second" in mine
            assert sum(v for n, labels, v in samples if n == "dtfm_job_state"
                       and labels["job_id"] == job.job_id) == 1.0  # one state each
        members = {labels["agent"]: labels["job_id"] for name, labels, _ in samples
                   if name == "dtfm_plan_member"}
        assert members == {"a2": big.job_id, "a3": big.job_id}
        assert ("dtfm_plan_cost_seconds", {"job_id": big.job_id, "part": "total"}, 1.5) \
            in samples

    asyncio.run(main())
