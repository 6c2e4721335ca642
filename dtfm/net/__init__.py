"""How bytes move between machines: the one-port front and its splice, the relay, the data-plane
hello, handshake and frames, hole punching, reachability, the probes' receiving end and the
agent's hand-off of dialled connections to its workers.

Imports neither program (`coordinator`, `agent`); the worker's `torch.distributed` backend
(agent/worker/transport) builds on its dataplane, punch and pathweigh modules, which import no
grpc and no torch.
"""
