"""`python -m tests.system.bad_agent start ...`: `agent start` whose workers scale every
gradient shard they send by 10 from their 10th optimizer step (issue 43): a bad volunteer on an
emulated host, made bad from outside the product as tests/system/bad_peer_job.py makes one on
loopback (tests/agent/worker/badpeer_hook.py, loaded by badpeer_site/sitecustomize.py in every
process the agent starts). The WAN cluster gives all its agents one environment without
DTFM_ variables, so this module sets the hook's own before the agent starts.
"""

from __future__ import annotations

import os

from agent.cli import main
from tests.system.bad_peer_job import REPO, SITE

ATTACK_FROM = 10  # each epoch's worker's 10th optimizer step, and every one after it
ATTACK_TO = 400

if __name__ == "__main__":
    os.environ["DTFM_TEST_BAD_PEER"] = "*:" + ",".join(
        f"{s}=scale" for s in range(ATTACK_FROM, ATTACK_TO))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(SITE), str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    raise SystemExit(main())
