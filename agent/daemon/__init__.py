"""The agent daemon: gRPC server, session with the coordinator, the worker's supervisor, identity,
config, metrics, state dir and the relay it may host.

Never imports a command (`agent.commands`).
"""
