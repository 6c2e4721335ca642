"""The coordinator daemon: the gRPC server, the agent registry, its configuration, metrics,
the state directory and the history it serves (docs/architecture.md, "Layout")."""
