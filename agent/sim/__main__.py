"""`python -m agent.sim`: one process of simulated agents (agent/sim/swarm.py says how to drive
it). Not a command for operators: bench/scale.py and the scale test start it."""

from __future__ import annotations

import argparse
import asyncio
import logging

from agent.sim.swarm import SwarmConfig, run_swarm
from dtfm.flags import add_security_args, security_from_args


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m agent.sim", description=__doc__)
    parser.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator")
    parser.add_argument("--world-seed", type=int, required=True,
                        help="draws the world of sites (never told to the coordinator)")
    parser.add_argument("--world-agents", type=int, required=True, help="agents in the world")
    parser.add_argument("--first", type=int, default=0, help="first agent index of this swarm")
    parser.add_argument("--count", type=int, required=True, help="agents this swarm runs")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="probe and start-up times are this many times the real ones")
    parser.add_argument("--log-level", default="warning")
    add_security_args(parser)
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(run_swarm(SwarmConfig(args.coordinator, security_from_args(args),
                                      args.world_seed, args.world_agents, args.first,
                                      args.count, args.time_scale)))


if __name__ == "__main__":
    main()
