"""Who may change what the coordinator runs: the operator token, apart from the join token.

The join token is every agent's, and agents are volunteers the coordinator does not trust
(issue 43's threat model). With it alone a hostile volunteer could cancel the operator's jobs
(`CancelJob`), queue its own (`SubmitJob`), or let an excluded accomplice back in (`Admit`).
So these operator calls (`OPERATOR_CALLS`) need a second secret that never leaves the
operator's hands: `coordinator start --operator-token-file PATH` (else $DTFM_OPERATOR_TOKEN;
$DTFM_OPERATOR_TOKEN_FILE and a TOML `operator_token_file` set the flag, as for every flag).
`coordinator submit/cancel/admit` send it as the call metadata `dtfm-operator-token`, from
their own --operator-token-file (defaulting the same way), on top of the join token
(or mTLS) that every call needs (`dtfm.rpc`). Without it, or with another, the call is refused
PERMISSION_DENIED with a message naming the flag. It is compared in constant time.

Mutual TLS has no client roles in dtfm (every certificate the cluster CA signed is an agent's
or the operator's alike), so the operator token applies over mTLS too.

Without an operator token the coordinator behaves as before (issue 46: access unchanged)
and says once at start that any holder of the join token may submit, cancel and admit.
This module owns both ends of the token: the flag, loading it, the check (`OperatorGate`)
and the metadata a client sends (`operator_metadata`).
"""

from __future__ import annotations

import argparse
import hmac
import logging

import grpc

from dtfm.net.ratelog import RateLog
from dtfm.rpc import ConfigError, check_token, load_token

log = logging.getLogger(__name__)

OPERATOR_FLAG = "--operator-token-file"
OPERATOR_ENV = "DTFM_OPERATOR_TOKEN"
OPERATOR_METADATA = "dtfm-operator-token"
OPERATOR_CALLS = ("SubmitJob", "CancelJob", "Admit")
_GRANTS = "submit, cancel and admit on the coordinator"
_WHERE = f"{OPERATOR_FLAG} or ${OPERATOR_ENV}"


def add_operator_arg(parser: argparse.ArgumentParser, server: bool) -> None:
    """`--operator-token-file`: on `coordinator start` (`server`) the token the operator
    calls need; on `submit`/`cancel`/`admit` the one they send."""
    parser.add_argument(OPERATOR_FLAG, default=None, metavar="PATH", help=(
        "file holding the operator token that SubmitJob, CancelJob and Admit need on top of "
        "the join token (else $DTFM_OPERATOR_TOKEN; default: none, and any holder of the "
        "join token may call them); keep it on the operator's machines only"
        if server else
        "file holding the coordinator's operator token (else $DTFM_OPERATOR_TOKEN), needed "
        "when the coordinator was started with --operator-token-file"))


def load_operator_token(path: str | None) -> str:
    """The operator token from `path`, else $DTFM_OPERATOR_TOKEN, else '' (none)."""
    return load_token(path, OPERATOR_ENV, _GRANTS)


def check_operator_token(token: str, join_token: str) -> None:
    """Refuse an operator token that is short, not printable ASCII, or the join token itself
    (which every agent holds, so it would guard nothing)."""
    if not token:
        return
    check_token(token, f"the operator token ({_WHERE})")
    if hmac.compare_digest(token.encode(), join_token.encode()):
        raise ConfigError(f"the operator token ({_WHERE}) is the join token, which every "
                          "agent holds: make another, for example `head -c 32 /dev/urandom "
                          "| base64 > FILE`")


def operator_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata a client sends with an operator call (none without a token)."""
    return ((OPERATOR_METADATA, token),) if token else ()


class OperatorGate:
    """The check of the operator calls, against the coordinator's operator token ('': none,
    every caller the join token let in passes)."""

    def __init__(self, token: str) -> None:
        self._expected = token.encode()
        self._log = RateLog(log)  # a refused caller cannot flood the log

    @property
    def required(self) -> bool:
        return bool(self._expected)

    def announce(self) -> None:
        """Say once, at start, who may call the operator calls."""
        if self.required:
            log.info("operator calls (%s) need the operator token (%s)",
                     ", ".join(OPERATOR_CALLS), OPERATOR_FLAG)
        else:
            log.warning("no operator token: any agent holding the join token can submit and "
                        "cancel jobs and admit excluded agents (%s); start the coordinator "
                        "with %s PATH (or $%s) to reserve them to the operator",
                        ", ".join(OPERATOR_CALLS), OPERATOR_FLAG, OPERATOR_ENV)

    def refusal(self, metadata: tuple[tuple[str, str | bytes], ...] | None,
                call: str) -> str:
        """Why `call` with this invocation metadata is refused, or '' when it may run."""
        if not self.required:
            return ""
        given = next((v for k, v in metadata or () if k == OPERATOR_METADATA), None)
        if given is None:
            return (f"{call} is an operator call: this coordinator needs its operator token "
                    f"as well as the join token; pass {OPERATOR_FLAG} PATH (or set "
                    f"${OPERATOR_ENV}) to `coordinator submit/cancel/admit`")
        given_b = given.encode() if isinstance(given, str) else bytes(given)
        if not hmac.compare_digest(given_b, self._expected):
            return (f"{call}: wrong operator token: use the file the coordinator's "
                    f"{OPERATOR_FLAG} names")
        return ""

    async def check(self, context: grpc.aio.ServicerContext, call: str) -> None:
        """Abort the call PERMISSION_DENIED unless it carries the operator token."""
        if reason := self.refusal(context.invocation_metadata(), call):
            # (no peer address: behind the shared port's front every caller is the front)
            self._log.warning(call, "refused %s: %s", call, reason)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, reason)
