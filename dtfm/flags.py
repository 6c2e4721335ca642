"""Command-line plumbing both entry points share: layered config, security flags, logging,
and the one mapping between the training flags and `TrainConfig`.

Precedence, the same for every daemon: flags override `DTFM_<FLAG>` environment variables,
which override a `--config FILE` (TOML, keys named like the flags), which overrides defaults.
`coordinator start` and `agent local` get their training flags from `add_train_args` and read
them back with `train_config_from_args`, so the two cannot drift apart again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import enum
import io
import logging
import math
import os
import re
import sys
import tomllib
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, NoReturn, Protocol, TypeVar

from dtfm.core import lora
from dtfm.core.codecs import check_setting
from dtfm.core.spec import (
    OUTER_MOMENTUM_AUTO,
    SYNC_AUTO,
    DpMode,
    Dtype,
    MomentsDtype,
    Schedule,
    TrainConfig,
)
from dtfm.core.verify import Verify
from dtfm.rpc import ConfigError, Security, load_token

T = TypeVar("T")
ENV_PREFIX = "DTFM_"
# --liveness-timeout's default: seconds without a heartbeat (one a second) before the
# coordinator marks an agent lost and stops the job's workers. 5 s flapped under load (five
# times during a `pip install` beside the agents). Measured (bench/heartbeat_gaps.py,
# docs/operations.md, "Liveness"): the largest gap between heartbeats was 2.0 s on loopback
# beside a busy loop and a pip-install-like load, 2.3 s from agents 238 ms away on the emulated
# world (its round trip is in every gap there), and a lost packet adds a TCP retransmission
# timeout that doubles. 15 s is 3x the gaps that flapped and over 6x the largest measured; a
# dead agent is noticed 10 s later than at 5 s.
LIVENESS_TIMEOUT_S = 15.0
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


# what `action=` an argument was added with, as the layered config sorts them: a boolean
# switch, a value, or anything else (which DTFM_* and TOML cannot set)
STORE, STORE_TRUE, STORE_FALSE, OTHER = "store", "store_true", "store_false", "other"


@dataclass(frozen=True)
class Argument:
    """One argument added to a `Parser`, in the order added, and the kind of its `action=`.

    argparse keeps its list of actions and their classes private; the layered config (DTFM_*
    and TOML, `layered_defaults`) and `name_origins` read this table instead.
    """

    action: argparse.Action
    kind: str  # STORE, STORE_TRUE, STORE_FALSE or OTHER


class ArgumentAdder(Protocol):
    """A parser or one of its groups: what `add_train_arg` adds a flag to."""

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action: ...


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line naming the flag, then exit 2.

    Its subparsers are Parsers too (argparse builds them with the parent's class). It keeps
    `arguments`, every argument added to it or to its groups (`Argument`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.arguments: list[Argument] = []  # before argparse adds -h and its groups
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{self.prog}: {message} (see `{self.prog} -h`)")

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        return self._record(super().add_argument(*args, **kwargs), kwargs)

    def add_argument_group(self, *args: Any, **kwargs: Any) -> Any:
        return self._recording(super().add_argument_group(*args, **kwargs))

    def add_mutually_exclusive_group(self, **kwargs: Any) -> Any:
        return self._recording(super().add_mutually_exclusive_group(**kwargs))

    def add_subparsers(self, **kwargs: Any) -> Any:
        return self._record(super().add_subparsers(**kwargs), {"action": OTHER})

    def _record(self, action: argparse.Action, kwargs: dict[str, Any]) -> argparse.Action:
        given = kwargs.get("action", STORE)
        kind = given if given in (STORE, STORE_TRUE, STORE_FALSE) else OTHER
        self.arguments.append(Argument(action, kind))
        return action

    def _recording(self, group: Any) -> Any:
        """`group` (argparse's, whose class is private) with its adds recorded here too."""
        add, exclusive = group.add_argument, group.add_mutually_exclusive_group

        def add_argument(*args: Any, **kwargs: Any) -> argparse.Action:
            return self._record(add(*args, **kwargs), kwargs)

        def add_mutually_exclusive_group(**kwargs: Any) -> Any:
            return self._recording(exclusive(**kwargs))

        group.add_argument = add_argument
        group.add_mutually_exclusive_group = add_mutually_exclusive_group
        return group


def arguments_of(parser: argparse.ArgumentParser) -> list[Argument]:
    """Every argument of `parser`, in the order added; it must be a `Parser` (which keeps them)."""
    if not isinstance(parser, Parser):
        raise TypeError(f"layered config needs a dtfm.flags.Parser, got {type(parser).__name__}")
    return parser.arguments


def number(kind: type[int] | type[float], minimum: float | None = 0, *,
           above: bool = False, maximum: float | None = None,
           unit: str = "") -> Callable[[str], Any]:
    """An argparse `type`: a finite int or float in range. Flags, DTFM_* and TOML share it."""
    what = _describe(kind, minimum, above, maximum) + unit

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        too_low = minimum is not None and (value <= minimum if above else value < minimum)
        too_high = maximum is not None and value > maximum
        if not math.isfinite(value) or too_low or too_high:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    parse.toml_types = (int,) if kind is int else (int, float)  # type: ignore[attr-defined]
    parse.__name__ = kind.__name__
    return parse


def _describe(kind: type, minimum: float | None, above: bool, maximum: float | None) -> str:
    if kind is int and minimum is not None and maximum is not None:
        return f"an integer from {minimum + above} to {maximum}"
    low = "" if minimum is None else f" {'>' if above else '>='} {minimum}"
    high = "" if maximum is None else f" and <= {maximum}"
    return f"{'an integer' if kind is int else 'a finite number'}{low}{high}"


UINT32 = 2**32 - 1
count = number(int, 0, maximum=UINT32)  # steps, restarts, ...: 0 or more
positive_count = number(int, 1, maximum=UINT32)  # batch, micro-batches, ...: 1 or more
seconds = number(float, 0, above=True, unit=" seconds")  # timeouts and intervals: > 0
seconds_or_off = number(float, 0, unit=" seconds (0: off)")


def codec_setting(flag: str, *, topk: bool) -> Callable[[str], str]:
    """An argparse `type` for --pp-compress / --dp-compress: a codec name or auto."""

    def parse(text: str) -> str:
        try:
            check_setting(text, topk=topk, what=flag)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text.strip()

    parse.__name__ = "codec"
    return parse


def sync_every_setting(text: str) -> int:
    """`--sync-every`: H >= 1, or auto (SYNC_AUTO: the coordinator chooses H from the measured
    links, `coordinator/scheduler/sync_auto.py`)."""
    if text.strip().lower() == "auto":
        return SYNC_AUTO
    try:
        return int(positive_count(text))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected an integer from 1 to {UINT32} or auto, got {text!r}") from None


sync_every_setting.toml_types = (int, str)  # type: ignore[attr-defined]


def outer_momentum_setting(text: str) -> float:
    """`--outer-momentum`: a number in [0, 1), or auto (OUTER_MOMENTUM_AUTO: by the round's
    length, `TrainConfig.outer_mu`)."""
    if text.strip().lower() == "auto":
        return OUTER_MOMENTUM_AUTO
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1) or auto, got {text!r}")
    return value


outer_momentum_setting.toml_types = (int, float, str)  # type: ignore[attr-defined]


# --- the training flags: one per TrainConfig field, the same in every command that trains ---

# How each field is parsed; its flag name, help text and default come from `TrainConfig`.
# An enum field is a string restricted to the enum's values (argparse `choices`, which the
# DTFM_* and TOML layers check too). A field missing here fails `add_train_args` loudly.
_TRAIN_TYPES: dict[str, Callable[[str], Any] | type[enum.StrEnum]] = {
    "global_batch": positive_count,
    "micro_batches": positive_count,
    "steps": count,
    "seed": number(int, 0, maximum=2**64 - 1),
    "schedule": Schedule,
    "dp_mode": DpMode,
    "lr": number(float, 0, above=True),
    "warmup_steps": count,
    "grad_clip": number(float),
    "weight_decay": number(float),
    "data_path": str,
    "checkpoint_dir": str,
    "dtype": Dtype,
    "checkpoint_every": count,
    "eval_batches": count,
    "eval_every": count,
    "pp_compress": codec_setting("--pp-compress", topk=False),
    "dp_compress": codec_setting("--dp-compress", topk=True),
    "moments_dtype": MomentsDtype,
    "init_from": str,
    "seq_len": count,
    "sync_every": sync_every_setting,
    "outer_lr": number(float, 0, above=True),
    "outer_momentum": outer_momentum_setting,
    "outer_delay": number(int, 0, maximum=1),
    "pipeline_delay": number(int, 0, maximum=1),
    "lora_rank": count,
    "lora_alpha": number(float, 0, above=True),
    "lora_dropout": number(float, 0, maximum=0.999),
    "lora_targets": str,
    "lora_init": str,
    "verify": Verify,
}
_TRAIN_METAVARS = {"data_path": "PATH", "checkpoint_dir": "DIR", "lr": "LR", "grad_clip": "NORM",
                   "weight_decay": "X", "pp_compress": "CODEC", "outer_lr": "LR",
                   "outer_momentum": "MU|auto", "dp_compress": "CODEC",
                   "init_from": "DIR", "sync_every": "H|auto", "lora_alpha": "ALPHA",
                   "lora_dropout": "P", "lora_targets": "NAMES",
                   "lora_init": "DIR"}  # and N for the integers
_TRAIN_FIELDS = {f.name: f for f in fields(TrainConfig)}
# (field, value) pairs that mean auto, shown as such in --help
_TRAIN_AUTO = {("sync_every", SYNC_AUTO), ("outer_momentum", OUTER_MOMENTUM_AUTO)}


def train_dest(name: str) -> str:
    """The argparse dest (and DTFM_* / TOML name) of TrainConfig field `name`: `batch` for
    `global_batch`, `data` for `data_path`, else the name itself."""
    return TrainConfig.flag_of(name).removeprefix("--").replace("-", "_")


def add_train_args(parser: argparse.ArgumentParser) -> None:
    """Add the group of training flags: one per `TrainConfig` field, defaulting to its default.

    Every command that trains calls this, so a field added to `TrainConfig` reaches every
    operator-facing flag set at once (a test compares `coordinator start` with `agent local`).
    """
    group = parser.add_argument_group("training")
    for f in fields(TrainConfig):
        add_train_arg(group, f.name)


def add_train_arg(parser: ArgumentAdder, name: str) -> None:
    """Add the flag of one `TrainConfig` field, exactly as `add_train_args` defines it: for a
    command that does not train but must describe the job the same way (`coordinator plan
    --dtype` sizes messages in what a job would send, with a job's default and choices)."""
    f = _TRAIN_FIELDS[name]
    kind = _TRAIN_TYPES[name]
    default = getattr(TrainConfig(), name)
    doc = str(f.metadata["doc"]).replace("%", "%%")
    extra: dict[str, Any] = {"type": kind}
    if isinstance(kind, type) and issubclass(kind, enum.StrEnum):
        extra = {"choices": [m.value for m in kind]}
        default = str(default)
    shown = "auto" if (name, default) in _TRAIN_AUTO else "%(default)s"
    help_text = doc + (f" (default: {shown})" if default != "" else "")
    metavar = _TRAIN_METAVARS.get(name, "N" if type(default) is int else None)
    parser.add_argument(TrainConfig.flag_of(name), dest=train_dest(name), default=default,
                        metavar=metavar, help=help_text, **extra)


class _OldName(argparse.Action):
    """A flag's former spelling: still sets the same value, and says what it is called now."""

    def __init__(self, *args: Any, new: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(f"{parser.prog}: {option_string} is the old name of {self.new}; use {self.new}",
              file=sys.stderr)
        setattr(namespace, self.dest, values)


SEARCH_SECONDS = "--search-seconds"


def add_search_seconds(parser: argparse.ArgumentParser, default: float | None,
                       default_note: str = "") -> None:
    """`--search-seconds`: the placement search's wall-clock limit, one definition for
    `coordinator start` and `coordinator plan`. `--seconds`, plan's former name for it, still
    works (hidden; it says the new name on stderr). `default_note` explains a None default."""
    what = "wall-clock limit of the placement search, in seconds"
    parser.add_argument(SEARCH_SECONDS, type=seconds, default=default, metavar="SECONDS",
                        help=f"{what} (default: {default_note or '%(default)s'})")
    parser.add_argument("--seconds", dest="search_seconds", type=seconds, action=_OldName,
                        new=SEARCH_SECONDS, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The `TrainConfig` the training flags (after the DTFM_* and TOML layers) describe.

    Not validated: the caller knows the replica count `validate` needs. `--init-from` naming
    a peft adapter directory is resolved here (`dtfm.core.lora.from_adapter_dir`), so both
    commands take it alike; ConfigError when the directory or a flag contradicting it is bad.
    """
    cfg = TrainConfig(**{f.name: getattr(args, train_dest(f.name)) for f in fields(TrainConfig)})
    try:  # --init-from a peft adapter directory: its base, and its adapters to continue
        return lora.from_adapter_dir(cfg)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def train_argv(config: TrainConfig) -> list[str]:
    """The training flags that reproduce `config`, for a launcher that starts a command which
    trains (the inverse of `train_config_from_args`); defaults are left out."""
    defaults, argv = TrainConfig(), []
    for f in fields(TrainConfig):
        value = getattr(config, f.name)
        if value != getattr(defaults, f.name):
            argv += [TrainConfig.flag_of(f.name), str(value)]
    return argv


def check_directory(path: str, flag: str) -> None:
    """Refuse (ConfigError naming `flag`) a directory flag whose directory cannot be used or
    created: a file there or in place of a folder above it, or no write permission. Creates
    nothing; the daemon makes the directory (private) when it starts. Without this check a
    `--state-dir` naming a file ended in a traceback from the first write."""
    target = Path(path)
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "is a file" if existing == target else f"cannot be made: {existing} is a file"
        raise ConfigError(f"{flag} {path} {where}; give a directory (it is created if "
                          f"missing)")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "" if existing == target else f" ({existing}, where it would be created)"
        raise ConfigError(f"{flag} {path}{what} is not writable by this user; give a "
                          f"directory it may write")


def _flag(action: argparse.Action) -> str:
    return max(action.option_strings, key=len) if action.option_strings else action.dest


def _toml_types(action: argparse.Action) -> tuple[type, ...]:
    return getattr(action.type, "toml_types", None) or {
        None: (str,), str: (str,), int: (int,), float: (int, float)}.get(action.type, (str,))


_KINDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
          dict: "a table", list: "an array"}


def _convert(argument: Argument, raw: Any, origin: str, toml: bool) -> Any:
    """`raw` from the environment or a TOML file, through the flag's own type and choices."""
    action = argument.action
    where = f"{origin} ({_flag(action)})"
    if argument.kind in (STORE_TRUE, STORE_FALSE):
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if toml or text not in ("1", "0", "true", "false", "yes", "no"):
            raise ConfigError(f"{where}: expected true or false, got {raw!r}")
        return text in ("1", "true", "yes")
    if argument.kind != STORE:
        raise ConfigError(f"{where}: this flag cannot be set from a file or the environment")
    wanted = _toml_types(action)
    if toml and (isinstance(raw, bool) or not isinstance(raw, wanted)):
        got = _KINDS.get(type(raw), type(raw).__name__)
        raise ConfigError(f"{where}: expected {_KINDS[wanted[-1]]}, got {got} {raw!r}")
    try:
        value = action.type(str(raw)) if action.type is not None else str(raw)  # type: ignore[misc]
    except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"{where}: {value!r} is not one of "
                          f"{', '.join(map(str, action.choices))}")
    return value


def load_toml(path: str, what: str = "config file") -> dict[str, Any]:
    """The TOML file at `path`; ConfigError naming it (as `what`) when unreadable or bad."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{what} {path} is not valid TOML: {exc}") from None


def _toml_defaults(path: str, actions: dict[str, Argument],
                   origins: dict[str, str]) -> dict[str, Any]:
    data = load_toml(path)
    defaults: dict[str, Any] = {}
    for key, value in data.items():
        dest = key.replace("-", "_")
        if dest not in actions:
            raise ConfigError(f"config file {path}: unknown key {key!r}; known: "
                              f"{', '.join(sorted(k.replace('_', '-') for k in actions))}")
        origins[dest] = f"config file {path}: {key}"
        defaults[dest] = _convert(actions[dest], value, origins[dest], True)
    return defaults


def layered_defaults(parser: argparse.ArgumentParser, argv: Sequence[str]) -> dict[str, str]:
    """Install the TOML file's and the environment's values as `parser`'s defaults, and
    return where each came from (dest -> `$DTFM_X` or `config file F: key`).

    Every value goes through the flag's own type and choices, as a flag would.
    """
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    # a hidden old name shares its dest (and is left out: its help is SUPPRESS)
    actions = {a.action.dest: a for a in arguments_of(parser)
               if a.action.dest not in _SKIP and a.action.help != argparse.SUPPRESS}
    origins: dict[str, str] = {}
    defaults = _toml_defaults(known.config, actions, origins) if known.config else {}
    for dest, action in actions.items():
        raw = os.environ.get(ENV_PREFIX + dest.upper())
        if raw is not None and dest != "token":
            origins[dest] = f"${ENV_PREFIX}{dest.upper()}"
            defaults[dest] = _convert(action, raw, origins[dest], False)
    parser.set_defaults(**defaults)
    return origins


def name_origins(message: str, parser: argparse.ArgumentParser, argv: Sequence[str],
                 origins: dict[str, str]) -> str:
    """`message` (a ConfigError's, naming flags) with each flag whose value came from the
    environment or the TOML file, not from `argv`, shown with where it came from, as
    `$DTFM_LISTEN (--listen)`: the flag alone sends a person to a command line that does not
    hold the bad value."""
    given = _given_on_command_line(parser, argv)
    for action in (a.action for a in arguments_of(parser)):
        origin = origins.get(action.dest)
        if origin is None or action.dest in given or not action.option_strings:
            continue
        flag = _flag(action)
        named = re.compile(rf"(?<![\w$-]){re.escape(flag)}(?![\w-])")
        message = named.sub(lambda _, o=origin, f=flag: f"{o} ({f})", message, count=1)
    return message


def _given_on_command_line(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The dests a flag in `argv` sets: argparse fills in a default only where the namespace
    lacks the dest, so whatever no longer holds the marker was set by `argv`."""
    marker = object()
    namespace = argparse.Namespace(**{a.action.dest: marker for a in arguments_of(parser)})
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # an old name's note, said once already
            parser.parse_known_args(list(argv), namespace)
    except (ConfigError, SystemExit):
        return set()
    return {dest for dest, value in vars(namespace).items() if value is not marker}


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
    origins: dict[str, str] = {}
    try:
        if argv and argv[0] in subs:
            origins = layered_defaults(subs[argv[0]], argv[1:])
        args = parser.parse_args(argv)
        if hasattr(args, "log_level"):
            setup_logging(args.log_level)
        return handlers[args.command](args)
    except ConfigError as exc:
        if origins:
            return fail(name_origins(str(exc), subs[argv[0]], argv[1:], origins))
        return fail(str(exc))


def standalone(prog: str, description: str,
               add_arguments: Callable[[argparse.ArgumentParser], None],
               run: Callable[[argparse.Namespace], int], argv: Sequence[str] | None) -> int:
    """`python -m MODULE` for a subcommand module that exposes add_arguments and run."""
    parser = Parser(prog=prog, description=description)
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except ConfigError as exc:
        return fail(str(exc))
    return run(args)


def hms(seconds: float) -> str:
    """`H:MM:SS` of a progress line's ETA; `-:--:--` while it is unknown (NaN, inf)."""
    if not math.isfinite(seconds):
        return "-:--:--"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def fail(message: str, code: int = 2) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code
