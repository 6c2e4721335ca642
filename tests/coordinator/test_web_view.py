"""The web view's pieces without a process: sessions, request heads, thinning, the timeline."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from coordinator.daemon.history import thin
from coordinator.web.server import MAX_HEADERS, BadRequest, base_url, parse_head
from coordinator.web.sessions import COOKIE, Sessions, cookie_value, login_url
from coordinator.web.view import MAX_EVENTS, Timeline

TOKEN = "test-token-0123456789"


def test_a_session_needs_the_token_and_expires() -> None:
    sessions = Sessions(TOKEN, secure=False, ttl_s=60, limit=2)
    assert not sessions.token_ok("") and not sessions.token_ok(TOKEN + "x")
    assert sessions.token_ok(TOKEN)
    header = sessions.open()
    assert "HttpOnly" in header and "SameSite=Strict" in header and "Secure" not in header
    session_id = header.split(";", 1)[0].split("=", 1)[1]
    assert sessions.valid(f"other=1; {COOKIE}={session_id}")
    assert not sessions.valid(f"{COOKIE}={session_id[:-1]}") and not sessions.valid("")
    sessions.open(), sessions.open()  # the oldest of more than `limit` goes
    assert not sessions.valid(f"{COOKIE}={session_id}") and len(sessions) == 2
    expired = Sessions(TOKEN, secure=True, ttl_s=-1)
    header = expired.open()
    assert "Secure" in header and not expired.valid(header.split(";", 1)[0])


def test_urls() -> None:
    assert login_url("http://h:1", "a b&c") == "http://h:1/login?token=a+b%26c"
    assert base_url("127.0.0.1:7080", tls=True) == "https://127.0.0.1:7080"
    assert base_url("[::1]:7080", tls=False) == "http://[::1]:7080"
    assert cookie_value("a=1; b=2", "b") == "2" and cookie_value("a=1", "b") == ""


def test_request_heads_are_read_strictly() -> None:
    r = parse_head(b"GET /login?token=x HTTP/1.1\r\nHost: h\r\nCookie: a=b\r\n\r\n")
    assert (r.method, r.path, r.query, r.headers["cookie"]) == ("GET", "/login",
                                                                  {"token": ["x"]}, "a=b")
    for bad in (b"GET /\r\n\r\n", b"GET / HTTP/1.1\r\nNoColon\r\n\r\n",
                b"GET / HTTP/1.1\r\n X: folded\r\n\r\n",
                b"POST / HTTP/1.1\r\nContent-Length: 3\r\n\r\n",
                b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * (MAX_HEADERS + 1) + b"\r\n"):
        with pytest.raises(BadRequest):
            parse_head(bad)


def test_thin_keeps_the_ends_and_the_bound() -> None:
    points = [{"step": i} for i in range(1000)]
    kept = thin(points, 100)
    assert len(kept) == 100 and kept[0]["step"] == 0 and kept[-1]["step"] == 999
    assert thin(points[:5], 100) == points[:5]
    assert thin(points, 1) == [points[-1]] and thin(points, 0) == []


def _status(now: float, states: dict[str, str], **job: Any) -> dict[str, Any]:
    agents = [{"id": i, "state": s, "joined": 1.0, "address": f"{i}:1",
               "device": {"kind": "cpu"}} for i, s in states.items()]
    base = {"id": "j", "state": "running", "message": "", "checkpoint_step": 0,
            "recoveries": [], "replans": []}
    plan = job.pop("plan", None)
    return {"time": now, "agents": agents, "job": {**base, **job}, "plan": plan}


def test_the_timeline_names_what_changed() -> None:
    t = Timeline()
    plan = {"epoch": 1, "grid": [["a"], ["b"]], "stages": 2, "replicas": 1,
            "predicted_step_s": 0.5}
    t.observe(_status(10, {"a": "alive", "b": "alive"}, plan=plan))
    t.observe(_status(11, {"a": "alive", "b": "alive"}, plan=plan))  # nothing new
    recovery = {"at_unix_s": 12.0, "planned": False, "layout_before": "2x1",
                "layout_after": "", "reason": "b lost"}
    replan = {"at_unix_s": 13.0, "at_step": 7, "outcome": "", "decision": "move",
              "gain_s": 30.0, "cost_s": 5.0, "trigger": "slow link"}
    new_plan = {**plan, "epoch": 2, "grid": [["a"], ["c"]]}
    t.observe(_status(14, {"a": "alive", "b": "lost", "c": "alive"}, checkpoint_step=5,
                      recoveries=[recovery], replans=[replan], plan=new_plan))
    kinds = [e["kind"] for e in t.events]
    assert kinds == ["join", "join", "job", "plan", "lost", "join", "checkpoint",
                     "recovery", "replan", "plan"], kinds
    assert "gain 30.0 s" in t.events[8]["text"]
    assert [p["epoch"] for p in t.plans] == [1]  # the past plan, for the planner tab
    done = copy.deepcopy(replan) | {"outcome": "moved"}
    t.observe(_status(15, {"a": "alive", "b": "alive", "c": "alive"}, checkpoint_step=5,
                      recoveries=[recovery], replans=[done], plan=new_plan))
    assert [e["kind"] for e in t.events][-2:] == ["back", "replan"]
    for i in range(MAX_EVENTS + 10):
        t.observe(_status(20 + i, {f"x{i}": "alive"}))
    assert len(t.events) == MAX_EVENTS


def test_each_relay_agents_load_is_listed() -> None:
    from coordinator.web.view import relay_loads
    from protos.dtfm.v1 import coordinator_pb2

    status = coordinator_pb2.ClusterStatus()
    plain = status.agents.add()
    plain.info.agent_id = "a"
    relay = status.agents.add()
    relay.info.agent_id, relay.info.relay_port = "r", 7443
    relay.progress.relay_forwarded_bytes, relay.progress.relay_refused_bytes = 5000, 7
    assert relay_loads(status) == [{"agent": "r", "port": 7443, "forwarded_bytes": 5000,
                                    "refused_bytes": 7}]


def test_polling_readers_get_a_bounded_history() -> None:
    from coordinator.daemon.history import History
    from protos.dtfm.v1 import common_pb2, coordinator_pb2

    history = History()
    for step in range(1, 5001):
        history.record("a", coordinator_pb2.ProgressReport(
            epoch=1, step=step, loss=3.0, step_s=1.0,
            worker_state=common_pb2.WORKER_STATE_TRAINING))
    job = coordinator_pb2.JobStatus()
    assert len(history.to_proto(job, 1, 0).points) == 5000  # GetHistory: all of it
    page = history.to_proto(job, 1, 0, limit=400).points
    assert len(page) == 400 and (page[0].step, page[-1].step) == (1, 5000)
    assert [p.step for p in history.to_proto(job, 1, 0, tail=3).points] == [4998, 4999, 5000]
