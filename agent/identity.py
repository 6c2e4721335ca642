"""A stable agent id, persisted in the state directory so restarts keep their identity.

The coordinator keys link matrices and plans by agent id; an agent that came back under a new
id would look like a stranger and lose its measured links.
"""

from __future__ import annotations

import os
import re
import socket
import uuid
from pathlib import Path

from protos.rpc import ConfigError

ID_FILE = "agent-id"


def load_or_create_id(state_dir: str) -> str:
    path = Path(state_dir) / ID_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            agent_id = path.read_text().strip()
            if agent_id:
                return agent_id
        host = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:40].strip("-") or "agent"
        agent_id = f"{host}-{uuid.uuid4().hex[:8]}"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(agent_id + "\n")
        os.replace(tmp, path)
        return agent_id
    except OSError as exc:
        raise ConfigError(
            f"cannot use state directory {state_dir}: {exc.strerror}; pass a writable "
            "--state-dir (each agent on one machine needs its own)"
        ) from exc
