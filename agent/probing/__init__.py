"""Link probing from the agent's side: ping and bandwidth to one peer, the punch probe, the host's
TCP tuning check and device detection.

Imports nothing of `agent` but itself.
"""
