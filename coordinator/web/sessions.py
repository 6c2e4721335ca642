"""Who may read the web view: the join token logs a browser in once, a session cookie after.

The Jupyter way: `coordinator web-url` prints `/login?token=...`; the server checks the token
(constant time), answers with a random session id in an HttpOnly, SameSite=Strict cookie and
a redirect to `/`, so the token leaves the address bar and the history. Sessions are kept by
the SHA-256 of their id, so looking one up leaks no timing about the id itself, and there is
a bounded number of them (the oldest goes first) that expire.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
import urllib.parse
from collections import OrderedDict

COOKIE = "dtfm_session"
MAX_SESSIONS = 64
SESSION_TTL_S = 12 * 3600.0


def login_url(base: str, token: str) -> str:
    """The URL that logs a browser in: `base` (scheme://host:port) + /login?token=..."""
    return f"{base}/login?{urllib.parse.urlencode({'token': token})}"


def _digest(session_id: str) -> bytes:
    return hashlib.sha256(session_id.encode("utf-8", "replace")).digest()


class Sessions:
    """The token check and the live sessions of one web server."""

    def __init__(self, token: str, secure: bool, ttl_s: float = SESSION_TTL_S,
                 limit: int = MAX_SESSIONS) -> None:
        self._token = token.encode()
        self.secure = secure  # served over TLS: the cookie says Secure
        self.ttl_s = ttl_s
        self.limit = limit
        self._live: OrderedDict[bytes, float] = OrderedDict()  # digest -> expiry (monotonic)

    def token_ok(self, given: str) -> bool:
        return bool(given) and hmac.compare_digest(given.encode("utf-8", "replace"),
                                                   self._token)

    def open(self) -> str:
        """A new session; returns its Set-Cookie header value."""
        session_id = secrets.token_urlsafe(32)
        self._live[_digest(session_id)] = time.monotonic() + self.ttl_s
        while len(self._live) > self.limit:
            self._live.popitem(last=False)
        flags = "; Secure" if self.secure else ""
        return (f"{COOKIE}={session_id}; Path=/; HttpOnly; SameSite=Strict; "
                f"Max-Age={int(self.ttl_s)}{flags}")

    def valid(self, cookie_header: str) -> bool:
        """Whether a Cookie header carries a live session."""
        session_id = cookie_value(cookie_header, COOKIE)
        if not session_id:
            return False
        key = _digest(session_id)
        expiry = self._live.get(key)
        if expiry is None:
            return False
        if expiry < time.monotonic():
            del self._live[key]
            return False
        return True

    def __len__(self) -> int:
        return len(self._live)


def cookie_value(header: str, name: str) -> str:
    """The value of cookie `name` in a Cookie header, or ''."""
    for part in header.split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value
    return ""
