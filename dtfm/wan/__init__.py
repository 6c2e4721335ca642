"""A WAN on one box: rehearse a wide-area deployment with per-pair delay and bandwidth.

This package is a test and benchmark harness. It owns the emulated network only: network
namespaces (one per host) with a TUN device each (:mod:`dtfm.wan.netns`), the user-space
forwarding process that adds per-pair one-way delay and serialization at a per-pair rate
(:mod:`dtfm.wan.emulator`; the kernel here has no ``netem``), hosts behind a NAT or a stateful
firewall (:mod:`dtfm.wan.nat`, translated in that forwarder), and the ``WanEmulator`` context
manager that builds and tears it down (:mod:`dtfm.wan.harness`). It must not import the
coordinator, the agent daemon or torch: it runs whatever processes you put inside the hosts.
"""

from dtfm.wan.harness import WanEmulator

__all__ = ["WanEmulator"]
