"""The agent's configuration: one dataclass, validated once at the edge."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from dtfm.checkpoints.copies import MIRROR_INTERVAL_S
from dtfm.core.limits import is_host
from dtfm.flags import check_directory
from dtfm.net.reach import OVERRIDES
from dtfm.rpc import ConfigError, Security, split_hostport

STATE_DIR_ENV = "DTFM_STATE_DIR"


def default_state_dir() -> str:
    return os.environ.get(STATE_DIR_ENV) or str(Path.home() / ".local" / "state" / "dtfm-agent")


@dataclass
class AgentConfig:
    coordinator: str = "127.0.0.1:7070"
    listen: str = "127.0.0.1:0"
    advertise: str = ""  # host peers use to reach us; default: the listen host
    state_dir: str = field(default_factory=default_state_dir)
    security: Security = field(default_factory=lambda: Security(token=""))
    device: str = "auto"  # auto, cpu or cuda
    max_backoff_s: float = 10.0
    bind_interface: str = ""  # the worker's collectives use this interface; default: advertised
    metrics_listen: str = ""  # HOST:PORT of the Prometheus endpoint; empty: off
    flops: float = 0.0  # report this FLOP/s instead of measuring (0: measure)
    memory: int = 0  # report this many bytes of device memory instead of detecting (0: detect)
    prewarm: bool = True  # keep a spare worker with torch imported (agent.supervisor)
    mirror_interval_s: float = MIRROR_INTERVAL_S  # how often a mirror asks for new checkpoints
    # can peers dial --advertise? auto: the coordinator finds out; yes/no: the operator says
    reachable: str = "auto"
    # the port peers dial this agent's dtfm data plane at when they can: 0 (the default) the
    # gRPC port itself (dtfm/net/front.py sorts the connections, dtfm/net/handoff.py passes them
    # to the worker); a port: the worker listens there itself
    data_port: int = 0
    # serve a dtfm relay for the job's dial-only pairs (issue 32): on the gRPC port (`relay`),
    # or on a port of its own (`relay_port`; 0: not on one)
    relay: bool = False
    relay_port: int = 0

    def validate(self) -> None:
        split_hostport(self.coordinator, "--coordinator")
        host, _ = split_hostport(self.listen, "--listen")
        if self.metrics_listen:
            split_hostport(self.metrics_listen, "--metrics-listen")
        if not self.advertise and host in ("0.0.0.0", "::", ""):
            raise ConfigError(
                f"--listen {self.listen} binds every interface, so peers cannot be told where "
                "to reach this agent: add --advertise HOST (this machine's reachable address)"
            )
        if not is_host(self.advertise_host):
            raise ConfigError(
                f"--advertise {self.advertise_host!r} is not an IPv4/IPv6 address or a DNS "
                "host name: give the address peers reach this machine at"
            )
        if not (math.isfinite(self.max_backoff_s) and self.max_backoff_s > 0):
            raise ConfigError(f"max_backoff_s must be a finite number > 0, got "
                              f"{self.max_backoff_s}")
        if not (math.isfinite(self.flops) and self.flops >= 0) or self.memory < 0:
            raise ConfigError(f"--flops and --memory must be >= 0 (0: measure), got "
                              f"{self.flops} and {self.memory}")
        if not (math.isfinite(self.mirror_interval_s) and self.mirror_interval_s > 0):
            raise ConfigError(f"--mirror-interval must be a number of seconds > 0, got "
                              f"{self.mirror_interval_s}")
        check_directory(self.state_dir, "--state-dir")
        if not 0 <= self.data_port <= 65535:
            raise ConfigError(f"--data-port must be a TCP port (1-65535; 0: share the gRPC "
                              f"port), got {self.data_port}")
        if not 0 <= self.relay_port <= 65535:
            raise ConfigError(f"--relay-port must be a TCP port (1-65535; 0: serve no relay), "
                              f"got {self.relay_port}")
        if self.reachable not in OVERRIDES:
            raise ConfigError(f"--reachable must be {', '.join(OVERRIDES)}, got "
                              f"{self.reachable!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.bind_interface:
            import socket

            names = [name for _, name in socket.if_nameindex()]
            if self.bind_interface not in names:
                raise ConfigError(f"--bind-interface {self.bind_interface!r} is not an "
                                  f"interface of this machine (it has {', '.join(names)})")
        self.security.validate()

    @property
    def data_shared(self) -> bool:
        """Whether the data plane is served on the gRPC port (the default: one port)."""
        return not self.data_port

    def data_port_for(self, grpc_port: int) -> int:
        """The data port to advertise, once the gRPC server has its port."""
        return self.data_port or grpc_port

    @property
    def advertise_host(self) -> str:
        return self.advertise or split_hostport(self.listen)[0]
