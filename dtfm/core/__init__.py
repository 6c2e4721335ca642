"""Types both programs and the worker agree on: pure Python, no torch, no grpc.

Owns the stage x replica `Layout` (the only rank arithmetic), `ModelSpec` and its presets,
`TrainConfig` and its enums, the shape choice, assignment building and input limits.
Imports nothing of ours outside `dtfm.core` except the generated protobuf messages.
"""
