"""`coordinator demo --wan world --nat N`: which emulated agents sit behind NAT routers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from coordinator.scheduler.scenarios import nat_agents, world_links


def test_nat_agents_are_spread_over_cities_and_two_share_a_site_where_a_city_has_two() -> None:
    one = world_links(1, 25.0)[2]
    alone, shared = nat_agents(one, 3)
    assert shared == [] and len(set(alone)) == 3
    assert len({one[i] for i in alone}) == 3  # three cities, not one region
    two = world_links(2, 25.0)[2]
    alone, shared = nat_agents(two, 4)
    assert shared == [[0, 1]] and two[0] == two[1]  # one site: one city's two agents
    assert len(alone) == 2 and not set(alone) & {0, 1}
    assert nat_agents(two, 0) == ([], [])


def test_more_nat_agents_than_agents_is_refused() -> None:
    with pytest.raises(ValueError, match="--nat 9: there are 8 agents"):
        nat_agents(world_links(1, 25.0)[2], 9)


@pytest.mark.timeout(60)
def test_nat_without_wan_says_what_it_needs() -> None:
    out = subprocess.run([sys.executable, "-m", "coordinator", "demo", "--nat", "2"],
                         capture_output=True, text=True, timeout=50)
    assert out.returncode != 0
    assert "--nat" in out.stderr and "--wan world" in out.stderr
