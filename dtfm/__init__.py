"""The library both dtfm programs share: no daemon logic lives here.

Owns, by layer (dependencies point down only):
- `dtfm.core`: types both sides of the wire agree on, with no torch and no grpc: the stage x
  replica layout and its rank arithmetic, the model spec and its presets, the training config
  and its enums, shape choice, assignment building, input limits.
- `dtfm.rpc` (gRPC plumbing: token, TLS, health, reflection), `dtfm.flags` (CLI plumbing and
  the one flags <-> TrainConfig mapping), `dtfm.procs` (signalling child processes),
  `dtfm.launcher` (the one way to start a worker and read its progress), `dtfm.metrics`
  (serving Prometheus text).
- `dtfm.wan`: the WAN emulator, a tool for tests, benchmarks and the demo.
Must not import `coordinator` or `agent`; `agent.worker` imports only `dtfm.core` from here.
"""
