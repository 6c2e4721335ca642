"""Loaded by every Python process started with this folder on PYTHONPATH: where the test sets
DTFM_TEST_BAD_PEER, the worker it spawns becomes a bad peer (tests/agent/worker/badpeer_hook.py),
from outside the product (no DTFM_FAULT)."""

import os

if os.environ.get("DTFM_TEST_BAD_PEER"):
    from tests.agent.worker import badpeer_hook

    badpeer_hook.install()
