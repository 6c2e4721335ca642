"""`python -m tests.system.lying_agent PORT start ...`: `agent start` that advertises data
port PORT whatever it serves (issue 41): a member that lies in `AgentInfo.data_port`. A seam
of the tests, not a product flag: it patches the one method that picks the advertised port.
"""

from __future__ import annotations

import sys

from agent.cli import main
from agent.daemon.config import AgentConfig

if __name__ == "__main__":
    lie = int(sys.argv.pop(1))
    AgentConfig.data_port_for = lambda self, grpc_port: lie  # type: ignore[method-assign]
    raise SystemExit(main())
