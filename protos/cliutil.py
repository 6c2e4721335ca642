"""Command-line plumbing both entry points share: layered config, security flags, logging.

Precedence, the same for every daemon: flags override `DTFM_<FLAG>` environment variables,
which override a `--config FILE` (TOML, keys named like the flags), which overrides defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tomllib
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from protos.rpc import ConfigError, Security, load_token

T = TypeVar("T")
ENV_PREFIX = "DTFM_"
_SKIP = {"help", "config", "command"}


def add_security_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("security")
    group.add_argument("--token-file", help="file holding the cluster's join token "
                       "(else $DTFM_TOKEN)")
    group.add_argument("--tls-cert", default="", help="PEM certificate of this process")
    group.add_argument("--tls-key", default="", help="PEM private key for --tls-cert")
    group.add_argument("--tls-ca", default="", help="PEM CA bundle: verifies peers; on a "
                       "server it turns on mutual TLS (clients must present certificates)")


def security_from_args(args: argparse.Namespace) -> Security:
    security = Security(token=load_token(args.token_file), tls_cert=args.tls_cert or "",
                        tls_key=args.tls_key or "", tls_ca=args.tls_ca or "")
    security.validate()
    return security


def add_common_args(parser: argparse.ArgumentParser, config_file: bool = True) -> None:
    if config_file:
        parser.add_argument("--config", help="TOML file of defaults, keys named like the flags")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"])


def _convert(action: argparse.Action, raw: Any, origin: str) -> Any:
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text not in ("1", "0", "true", "false", "yes", "no"):
            raise ConfigError(f"{origin}: expected true or false, got {raw!r}")
        return text in ("1", "true", "yes")
    if action.type is not None and isinstance(raw, str | int | float):
        try:
            return action.type(raw)  # type: ignore[misc]
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{origin}: {exc}") from None
    return raw


def layered_defaults(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """Install the TOML file's and the environment's values as `parser`'s defaults."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    actions = {a.dest: a for a in parser._actions if a.dest not in _SKIP}
    defaults: dict[str, Any] = {}
    if known.config:
        try:
            with open(known.config, "rb") as f:
                data = tomllib.load(f)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {known.config}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {known.config} is not valid TOML: {exc}") from None
        for key, value in data.items():
            dest = key.replace("-", "_")
            if dest not in actions:
                raise ConfigError(f"config file {known.config}: unknown key {key!r}; known: "
                                  f"{', '.join(sorted(k.replace('_', '-') for k in actions))}")
            defaults[dest] = _convert(actions[dest], value, f"{known.config}: {key}")
    for dest, action in actions.items():
        raw = os.environ.get(ENV_PREFIX + dest.upper())
        if raw is not None and dest != "token":
            defaults[dest] = _convert(action, raw, f"${ENV_PREFIX}{dest.upper()}")
    parser.set_defaults(**defaults)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run on uvloop where installed (the daemons' event loop), else plain asyncio."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(coro)
    return uvloop.run(coro)


def dispatch(parser: argparse.ArgumentParser, subs: dict[str, argparse.ArgumentParser],
             argv: Sequence[str] | None,
             handlers: dict[str, Callable[[argparse.Namespace], int]]) -> int:
    """Parse (with layered defaults for the chosen subcommand) and run its handler."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in subs:
            layered_defaults(subs[argv[0]], argv[1:])
        args = parser.parse_args(argv)
        if hasattr(args, "log_level"):
            setup_logging(args.log_level)
        return handlers[args.command](args)
    except ConfigError as exc:
        return fail(str(exc))


def standalone(prog: str, description: str,
               add_arguments: Callable[[argparse.ArgumentParser], None],
               run: Callable[[argparse.Namespace], int], argv: Sequence[str] | None) -> int:
    """`python -m MODULE` for a subcommand module that exposes add_arguments and run."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def fail(message: str, code: int = 2) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code
