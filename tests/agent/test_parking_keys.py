"""What a waiting data-plane connection counts against (dtfm/net/parking.py), and the log that
a stranger cannot flood (dtfm/net/ratelog.py): pure functions, no sockets."""

from __future__ import annotations

import logging

import pytest

from dtfm.net.frontlimits import source_of as source_key
from dtfm.net.ratelog import RateLog


def test_a_source_is_an_ipv4_address_or_an_ipv6_slash_64() -> None:
    assert source_key("192.0.2.7") == "192.0.2.7"
    assert source_key("::ffff:192.0.2.7") == "192.0.2.7"  # a dual-stack socket's IPv4 peer
    # one host may hold a whole /64: its addresses count as one source
    assert source_key("2001:db8:1:2::1") == source_key("2001:db8:1:2:ffff::9") \
        == "2001:db8:1:2::/64"
    assert source_key("2001:db8:1:3::1") != source_key("2001:db8:1:2::1")
    assert source_key("fe80::1%eth0") == "fe80::/64"
    assert source_key("") == "unknown"


def test_the_rate_log_writes_one_line_per_kind_per_period_and_counts_the_rest(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    rl = RateLog(logging.getLogger("test.ratelog"), every_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.ratelog"):
        assert rl.warning("refused", "refused %s", "a")
        assert not any(rl.warning("refused", "refused %s", "b") for _ in range(999))
        assert rl.warning("evicted", "evicted one")  # another kind has its own budget
        now[0] += 10.0
        assert rl.warning("refused", "refused %s", "c")
    assert [r.getMessage() for r in caplog.records] == [
        "refused a", "evicted one", "refused c (and 999 more like it in the last 10 s)"]
