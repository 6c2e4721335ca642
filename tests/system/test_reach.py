"""Reachability found by dialling back, with real daemons on loopback (issue 32).

Loopback has many addresses: an agent listening on 127.0.0.1:P that advertises 127.0.0.2 is
one nobody can dial (connection refused), as behind a NAT; one listening on 127.0.0.5:P that
advertises 127.0.0.1 shares its advertised HOST:PORT with the agent that really sits there,
as two agents behind different NATs both believe they are 192.168.1.2:7071.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.daemons import Daemons, free_port, wait_for

pytestmark = pytest.mark.timeout(120)


def _dialled(daemons: Daemons, address: str, name: str) -> bool:
    """Whether agent `name` has been dialled back with success at least once."""
    path = daemons.tmp / name / "agent-id"
    if not path.exists():
        return False
    agent_id = path.read_text().strip()
    return any(a["id"] == agent_id and any(not d.get("error") for d in a["reach"]["dials"])
               for a in daemons.status(address)["agents"])


def _by_id(daemons: Daemons, address: str, names: list[str]) -> dict[str, dict[str, Any]]:
    """name -> the agent's status row, once every named agent is in and has a verdict."""
    ids = {name: (daemons.tmp / name / "agent-id").read_text().strip()
           for name in names if (daemons.tmp / name / "agent-id").exists()}
    if len(ids) < len(names):
        return {}
    rows = {a["id"]: a for a in daemons.status(address)["agents"]}
    out = {name: rows[i] for name, i in ids.items() if i in rows}
    if len(out) < len(names) or any(
            r["reach"]["verdict"] == "unknown" or (not r["reach"]["overridden"]
                                                   and len(r["reach"]["dials"]) < 2)
            for r in out.values()):
        return {}
    return out


def test_dial_back_finds_who_is_reachable_by_id_not_address(daemons: Daemons) -> None:
    """Open agent: everywhere; unroutable advertise: nowhere; a second agent advertising the
    first one's HOST:PORT: nowhere (the first answers, by its own id), and both are listed."""
    _, address = daemons.coordinator("--model", "gpt-tiny", "--agents", "5",
                                         "--stages", "1", "--replicas", "5", "--batch", "10")
    port = free_port()
    daemons.agent(address, "open", "--listen", f"127.0.0.1:{port}")
    # open must be listening before twin joins, or twin's dial-back finds nobody there
    # (refused) instead of open answering by its own id
    wait_for(lambda: _dialled(daemons, address, "open"), 60, "open's first dial-back")
    daemons.agent(address, "twin", "--listen", f"127.0.0.5:{port}", "--advertise", "127.0.0.1")
    daemons.agent(address, "natted", "--listen", "127.0.0.1:0", "--advertise", "127.0.0.2")
    daemons.agent(address, "peer", "--listen", "127.0.0.1:0")
    names = ["open", "twin", "natted", "peer"]
    rows = wait_for(lambda: _by_id(daemons, address, names), 60, "four verdicts")
    verdicts = {n: r["reach"]["verdict"] for n, r in rows.items()}
    assert verdicts == {"open": "everywhere", "twin": "nowhere", "natted": "nowhere",
                        "peer": "everywhere"}, rows
    # twin and open share one advertised address, yet are two rows with their own verdicts
    assert rows["twin"]["address"] == rows["open"]["address"] == f"127.0.0.1:{port}"
    assert rows["twin"]["id"] != rows["open"]["id"]
    twin_errors = " ".join(d["error"] for d in rows["twin"]["reach"]["dials"])
    assert f"answered as agent {rows['open']['id']}" in twin_errors, rows["twin"]["reach"]
    # peers dialled too, not only the coordinator
    assert any(d["dialer"] not in ("coordinator",) for r in rows.values()
               for d in r["reach"]["dials"]), rows
    # the text status has the column and says who cannot be dialled, and the waiting job names
    # them and says they are relayed
    text = daemons.cli("coordinator", "status", "--coordinator", address).stdout
    assert "REACH" in text and "nowhere (0/" in text and "everywhere (" in text, text
    assert f"{rows['natted']['id']}: not reachable" in text, text
    message = daemons.status(address)["job"]["message"]
    assert "relayed through the coordinator" in message and rows["natted"]["id"] in message \
        and rows["twin"]["id"] in message and rows["open"]["id"] not in message, message
    # each agent logged the verdict in one line
    logs = {p.stem: p.read_text(errors="replace") for p in daemons.tmp.glob("*.log")}
    assert "reachable from everywhere" in logs["open"], logs["open"][-2000:]
    natted = rows["natted"]["address"]
    assert f"not reachable: peers cannot dial {natted}" in logs["natted"], logs["natted"][-2000:]
    assert logs["natted"].count("not reachable:") == 1, logs["natted"][-3000:]  # once, not per dial


def test_the_operators_word_overrides_detection(daemons: Daemons) -> None:
    """--reachable yes on an undialable agent, DTFM_REACHABLE=no on a dialable one: the
    coordinator takes them as given and dials nothing."""
    _, address = daemons.coordinator()
    daemons.agent(address, "says-yes", "--listen", "127.0.0.1:0", "--advertise", "127.0.0.2",
                  "--reachable", "yes")
    daemons.agent(address, "says-no", "--listen", "127.0.0.1:0",
                  env=daemons.env(DTFM_REACHABLE="no"))
    rows = wait_for(lambda: _by_id(daemons, address, ["says-yes", "says-no"]), 60,
                    "two verdicts")
    yes, no = rows["says-yes"]["reach"], rows["says-no"]["reach"]
    assert (yes["verdict"], yes["overridden"], yes["dials"]) == ("everywhere", True, []), yes
    assert (no["verdict"], no["overridden"], no["dials"]) == ("nowhere", True, []), no
    text = daemons.cli("coordinator", "status", "--coordinator", address).stdout
    assert "everywhere (--reachable)" in text and "nowhere (--reachable)" in text, text
    bad = daemons.cli("agent", "start", "--coordinator", address, "--reachable", "maybe")
    assert bad.returncode == 2 and "--reachable" in bad.stderr, bad.stderr
