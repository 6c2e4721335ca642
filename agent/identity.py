"""A stable agent id, persisted in the state directory so restarts keep their identity.

The coordinator keys link matrices and plans by agent id; an agent that came back under a new
id would look like a stranger and lose its measured links.
"""

from __future__ import annotations

import re
import socket
import uuid
from pathlib import Path

from agent.statedir import private_dir, write_private
from protos.limits import AGENT_ID_RE
from protos.rpc import ConfigError

ID_FILE = "agent-id"


def load_or_create_id(state_dir: str) -> str:
    """The id stored in `state_dir` (made private, 0700), or a new one stored there (0600)."""
    path = Path(state_dir) / ID_FILE
    try:
        private_dir(path.parent)
        if path.exists():
            agent_id = path.read_text(errors="replace").strip()
            if agent_id:
                return _checked(agent_id, path)
        host = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:40].strip("-") or "agent"
        agent_id = f"{host}-{uuid.uuid4().hex[:8]}"
        write_private(path, (agent_id + "\n").encode())
        return agent_id
    except OSError as exc:
        raise ConfigError(
            f"cannot use state directory {state_dir}: {exc.strerror}; pass a writable "
            "--state-dir (each agent on one machine needs its own)"
        ) from exc


def _checked(agent_id: str, path: Path) -> str:
    if not AGENT_ID_RE.match(agent_id):
        raise ConfigError(f"{path} holds an invalid agent id (1-64 letters, digits, '.', '_' "
                          "or '-'): fix it, or delete it to get a new id")
    return agent_id
