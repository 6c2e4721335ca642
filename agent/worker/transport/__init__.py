"""The worker's data plane for peers that cannot all accept connections (issue 32).

A `torch.distributed` backend named "dtfm" (`backend.register`), so the worker's one training
path (isend/irecv, all_reduce, new_group) runs unchanged over it. Connections need no
inbound port on a rank that cannot listen: it dials, and two such ranks meet at a relay
(`dtfm/net/relay.py`). Every connection proves it holds the job's key first
(`dtfm/net/dataplane.py`). The peer table comes from the assignment (`config.py`), not from
a store on rank 0.

Modules: `config` (the peer table), `mesh` (connections and tagged messages), `staging`
(GPU and strided tensors through host copies), `work` (the `Work` objects), `backend` (the
process groups). Imports torch; never grpc or the coordinator.
"""

from agent.worker.transport.backend import NAME, mesh, register
from agent.worker.transport.config import TransportConfig

__all__ = ["NAME", "TransportConfig", "mesh", "register"]
