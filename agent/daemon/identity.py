"""A stable agent id, persisted in the state directory so restarts keep their identity.

The coordinator keys link matrices and plans by agent id; an agent that came back under a new
id would look like a stranger and lose its measured links.

Beside the id lives the secret the coordinator issued for it (`agent-secret`, 0600): it proves
the id on every Join and report, so a copy of the id alone (a cloned VM) cannot take over.
"""

from __future__ import annotations

import logging
import re
import socket
import uuid
from pathlib import Path

from agent.daemon.statedir import private_dir
from dtfm.core.files import write_private
from dtfm.core.limits import AGENT_ID_RE
from dtfm.rpc import ConfigError

log = logging.getLogger(__name__)

ID_FILE = "agent-id"
SECRET_FILE = "agent-secret"
_SECRET_RE = re.compile(r"^[0-9a-f]{64}$")


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


class SecretFile:
    """The coordinator-issued secret for this agent's id, kept in the state directory (0600)."""

    def __init__(self, state_dir: str | None) -> None:
        self.path = Path(state_dir) / SECRET_FILE if state_dir else None

    def load(self) -> str:
        """The stored secret, or "" (none yet, or a malformed file: the coordinator decides)."""
        if self.path is None or not self.path.exists():
            return ""
        secret = self.path.read_text(errors="replace").strip()
        if not _SECRET_RE.match(secret):
            log.warning("%s does not hold 64 hex digits; joining without a secret", self.path)
            return ""
        return secret

    def save(self, secret: str) -> None:
        """Keep `secret` (0600); a failure is logged, since the session works on without it."""
        if self.path is None or not _SECRET_RE.match(secret):
            return
        try:
            write_private(self.path, (secret + "\n").encode())
        except OSError as exc:
            log.warning("cannot store the agent secret in %s: %s; a restart of this agent "
                        "will be refused until the coordinator forgets its id", self.path,
                        exc.strerror)
