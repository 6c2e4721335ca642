"""The wire, and only the wire: `.proto` files under `protos/dtfm/v1/`, their generated stubs,
and the generator (`python -m protos.generate`). Shared Python types live in `dtfm`.
"""
