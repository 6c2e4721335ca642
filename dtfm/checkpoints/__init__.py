"""Stage checkpoints that both daemons move: copies pulled agent to agent and pushes to the
coordinator's copy of last resort. The on-disk format is `dtfm.core.checkpoints`.

Imports neither program.
"""
