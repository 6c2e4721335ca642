"""The coordinator's web view (`coordinator start --web HOST:PORT`): one read-only page and the
JSON behind it, served from the coordinator's own event loop (server.py), behind the join token
(sessions.py), built from the same status answer as `coordinator status --json` (view.py)."""
