"""The agent's user commands besides the daemon: `agent local`, `agent prepare` (and its text
input), `agent generate`.

Only agent/cli.py imports them.
"""
