"""The wire and the shared vocabulary of dtfm.

Owns: the `.proto` files under `protos/dtfm/v1/` and their generated stubs, plus the small
pure-Python types that both sides of the wire must agree on (the stage x replica layout, the
model spec and the training config) and the gRPC plumbing both daemons share (auth, TLS).
Must not import `coordinator` or `agent`, nor torch.
"""
