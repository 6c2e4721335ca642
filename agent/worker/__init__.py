"""The training runtime a dtfm agent spawns: one process, one pipeline stage of one replica.

Owns the torch side of dtfm (model, stages, pipeline schedules, data parallelism, data,
checkpoints). It reads an `Assignment` and nothing else; it must never import `coordinator`,
so a worker can run on a machine that only has the agent installed.
"""
