"""Simulated agents: many in one process, speaking the real gRPC API to a real coordinator.

What a coordinator of a thousand agents must hold cannot be run on one machine with real
agents (each is a daemon and a torch worker), but the coordinator only ever sees the wire. A
simulated agent is the real agent's session (`agent.daemon.session.CoordinatorSession`: Join,
heartbeats, commands, reports) with its two machine-bound parts replaced: link probes are
answered from a model of sites (`world.World`), taking as long as the real probe would, and
the worker is a pace-keeper that reports the steps the plan's step model predicts
(`agent.SimSupervisor`). `swarm` runs many of them in one asyncio process; bench/scale.py and
the scale test drive a few such processes against a real `coordinator start`.
"""
