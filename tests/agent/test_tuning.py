"""The agent's check of its host's TCP settings, fed fake /proc/sys trees (never this
machine's): what it advises, against which links, and that it says it once."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from agent.probing import tuning
from agent.probing.tuning import Link, TuningCheck, check
from protos.dtfm.v1 import common_pb2

REPO = Path(__file__).resolve().parents[2]
LINUX_DEFAULTS = {
    "net.core.rmem_max": "212992",
    "net.core.wmem_max": "212992",
    "net.ipv4.tcp_rmem": "4096\t131072\t6291456",
    "net.ipv4.tcp_wmem": "4096\t16384\t4194304",
    "net.ipv4.tcp_slow_start_after_idle": "1",
}
# Seoul-London: 476 ms round trip, 100 Mbit/s: 5.7 MiB in flight, 11.4 MiB of buffer
FAR_FAT = Link("seoul", 0.476, 100e6)
NEAR = Link("next-door", 0.004, 1e9)  # 0.5 MB in flight


def proc_sys(root: Path, values: dict[str, str]) -> Path:
    for key, value in values.items():
        path = root / key.replace(".", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(value + "\n")
    return root


def test_wanted_values_are_the_deployed_conf_file() -> None:
    conf = {}
    for line in (REPO / tuning.CONF).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, value = (part.strip() for part in line.split("=", 1))
            conf[key] = value
    assert conf == tuning.WANTED


def test_a_tuned_host_gets_no_advice(tmp_path: Path) -> None:
    root = proc_sys(tmp_path, tuning.WANTED)
    assert check(root, [FAR_FAT, NEAR]) == []


def test_slow_start_after_idle_is_advised_at_start_with_its_cost(tmp_path: Path) -> None:
    root = proc_sys(tmp_path, LINUX_DEFAULTS)
    (advice,) = check(root)  # no links yet: the buffers are not judged
    assert advice.line == "net.ipv4.tcp_slow_start_after_idle = 0"
    assert advice.current == "1"
    assert "17 %" in advice.why


def test_buffers_are_judged_against_the_widest_measured_link(tmp_path: Path) -> None:
    root = proc_sys(tmp_path, LINUX_DEFAULTS)
    near = {a.setting for a in check(root, [NEAR])}
    assert near == {"net.ipv4.tcp_slow_start_after_idle", "net.core.rmem_max",
                    "net.core.wmem_max"}  # 1 MiB of buffer needed, tcp_[rw]mem allow 4-6
    far = {a.setting: a for a in check(root, [NEAR, FAR_FAT])}
    assert set(far) == set(tuning.WANTED)
    rmem = far["net.ipv4.tcp_rmem"]
    assert rmem.current == "4096 131072 6291456"
    assert rmem.line == "net.ipv4.tcp_rmem = 4096 131072 67108864"
    assert "seoul" in rmem.why and "476 ms" in rmem.why and "at most about 53 Mbit/s" in rmem.why


def test_a_link_beyond_the_conf_files_buffers_asks_for_more(tmp_path: Path) -> None:
    root = proc_sys(tmp_path, tuning.WANTED)
    huge = Link("far-10g", 0.3, 10e9)  # 375 MB in flight
    advice = {a.setting: a for a in check(root, [huge])}
    assert set(advice) == {"net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem", "net.core.rmem_max",
                           "net.core.wmem_max"}
    wanted = int(advice["net.ipv4.tcp_rmem"].wanted.split()[-1])
    assert wanted >= 2 * huge.bdp_bytes and wanted % 2**20 == 0
    assert advice["net.ipv4.tcp_rmem"].wanted.startswith("4096 131072 ")


def test_settings_the_host_does_not_expose_are_not_advised(tmp_path: Path) -> None:
    assert check(tmp_path, [FAR_FAT]) == []
    root = proc_sys(tmp_path, {"net.ipv4.tcp_rmem": "garbage"})
    assert check(root, [FAR_FAT]) == []


def test_the_check_says_each_finding_once_and_reports_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = proc_sys(tmp_path, LINUX_DEFAULTS)
    session_check = TuningCheck(root)
    with caplog.at_level(logging.WARNING, logger="agent.probing.tuning"):
        session_check.run()
        session_check.run()
    assert len(caplog.records) == 1
    assert "tcp_slow_start_after_idle = 0" in caplog.text and tuning.CONF in caplog.text
    caplog.clear()
    sample = common_pb2.LinkSample(peer_id="seoul", reachable=True, bandwidth_gbps=0.1)
    session_check.observe(sample, 0.476)
    session_check.observe(common_pb2.LinkSample(peer_id="dead", reachable=False), 0.1)
    with caplog.at_level(logging.WARNING, logger="agent.probing.tuning"):
        advice = session_check.run()
    assert len(caplog.records) == 1 and "tcp_slow_start" not in caplog.text
    assert "net.ipv4.tcp_rmem = 4096 131072 67108864" in caplog.text
    assert list(session_check.links) == ["seoul"]
    wire = session_check.to_proto()
    assert [w.setting for w in wire] == [a.setting for a in advice]
    assert wire[0].wanted == "0" and wire[0].why
