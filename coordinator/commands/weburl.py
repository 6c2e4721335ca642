"""`coordinator web-url`: print the URL that opens the coordinator's web view, logged in.

The Jupyter way: the URL carries the cluster's join token once (`/login?token=...`); the
coordinator swaps it for a session cookie and sends the browser on to `/`, so the token leaves
the address bar. The token is read from the same `--token-file` / `DTFM_TOKEN` as every other
command; `--tls-cert` (or `--tls-ca`) makes the URL https, as `coordinator start` serves it.
"""

from __future__ import annotations

import argparse
import sys

from coordinator.web.server import base_url
from coordinator.web.sessions import login_url
from dtfm import flags
from dtfm.rpc import ConfigError, listening


def add_arguments(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--web", default=default, metavar="HOST:PORT",
                   help="the --web address the coordinator serves its view on (default: "
                   "%(default)s); for a remote one, the local end of an SSH tunnel")
    flags.add_security_args(p)
    flags.add_common_args(p, config_file=False)


def run(args: argparse.Namespace) -> int:
    security = flags.security_from_args(args)
    try:
        security.validate()
        url = login_url(base_url(args.web, security.tls), security.token)
    except ConfigError as exc:
        return flags.fail(str(exc))
    print(url)
    if not listening(args.web.replace("0.0.0.0", "127.0.0.1")):
        print(f"note: nothing answers on {args.web} yet: start the coordinator with --web "
              f"{args.web} (or tunnel to it: ssh -L PORT:127.0.0.1:PORT HOST)", file=sys.stderr)
    return 0
