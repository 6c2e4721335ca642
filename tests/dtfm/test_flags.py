"""The one flags <-> TrainConfig mapping: both commands that train speak it, in both directions.

`coordinator start` and `agent local` once spelt warmup differently and the coordinator lacked
half the knobs; these tests pin that every `TrainConfig` field is one flag with one spelling and
one default in both, that the DTFM_* and TOML layers reach it, and that what the flags say is
what the worker receives (through the Assignment's proto).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import fields
from pathlib import Path

import pytest

from agent.cli import build_parser as agent_parser
from coordinator.cli import build_parser as coordinator_parser
from dtfm import flags
from dtfm.core.spec import DpMode, Dtype, Schedule, TrainConfig
from dtfm.rpc import ConfigError


def _start() -> argparse.ArgumentParser:
    return coordinator_parser()[1]["start"]


def _local() -> argparse.ArgumentParser:
    return agent_parser()[1]["local"]


def _training(parser: argparse.ArgumentParser) -> list[tuple[object, ...]]:
    group = next(g for g in parser._action_groups if g.title == "training")
    return [(a.option_strings, a.dest, a.default, a.choices, a.metavar, a.help,
             getattr(a.type, "__name__", a.type)) for a in group._group_actions]


def _help_section(parser: argparse.ArgumentParser) -> str:
    text = parser.format_help()
    return text[text.index("\ntraining:\n"):]


def test_both_commands_expose_the_same_training_flags() -> None:
    start, local = _start(), _local()
    assert _training(start) == _training(local)
    section = _help_section(start)
    assert section == _help_section(local)  # `--help` shows the same names and defaults
    for name in ("--batch", "--warmup-steps", "--grad-clip", "--weight-decay",
                 "--eval-batches", "--dtype", "--dp-mode", "--schedule", "--checkpoint-every"):
        assert re.search(rf"^  {name} ", section, re.M), name


def test_every_field_is_one_flag_defaulting_to_train_configs_default() -> None:
    defaults = TrainConfig()
    for parser in (_start(), _local()):
        args = parser.parse_args([])
        flag_dests = {a.dest for a in parser._actions}
        for f in fields(TrainConfig):
            dest = flags.train_dest(f.name)
            assert dest in flag_dests, f"{f.name} has no flag"
            assert getattr(args, dest) == getattr(defaults, f.name), f.name
        assert flags.train_config_from_args(args) == defaults


def test_flags_round_trip_through_train_config() -> None:
    config = TrainConfig(global_batch=12, micro_batches=3, steps=7, seed=2**63, schedule="1f1b",
                         dp_mode="allreduce", lr=3e-4, warmup_steps=0, grad_clip=0.0,
                         weight_decay=0.0, data_path="/d/x.bin", checkpoint_dir="/ck",
                         dtype="bf16", checkpoint_every=5, eval_batches=0)
    argv = flags.train_argv(config)
    assert "--warmup-steps" in argv and "--grad-clip" in argv
    for parser in (_start(), _local()):
        assert flags.train_config_from_args(parser.parse_args(argv)) == config
    assert flags.train_argv(TrainConfig()) == []


def test_the_old_local_warmup_spelling_still_works() -> None:
    assert _local().parse_args(["--warmup", "3"]).warmup_steps == 3


def test_environment_and_toml_layers_reach_the_training_flags(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('grad-clip = 0.5\nschedule = "1f1b"\neval-batches = 1\n')
    monkeypatch.setenv("DTFM_WEIGHT_DECAY", "0.01")
    monkeypatch.setenv("DTFM_EVAL_BATCHES", "2")
    parser = _start()
    argv = ["--config", str(toml), "--eval-batches", "3"]
    flags.layered_defaults(parser, argv)
    config = flags.train_config_from_args(parser.parse_args(argv))
    assert (config.grad_clip, config.weight_decay, config.eval_batches) == (0.5, 0.01, 3)
    assert config.schedule is Schedule.ONE_F_ONE_B
    monkeypatch.setenv("DTFM_DP_MODE", "ring")
    with pytest.raises(ConfigError, match="DTFM_DP_MODE.*allreduce, sharded"):
        flags.layered_defaults(_local(), [])


def test_fp16_is_refused_naming_the_flag_and_the_choices() -> None:
    with pytest.raises(ConfigError, match="--dtype.*'fp16'.*'fp32', 'bf16'"):
        _local().parse_args(["--dtype", "fp16"])
    with pytest.raises(ValueError, match=r"--dtype must be one of fp32, bf16, got 'fp16'"):
        TrainConfig(dtype="fp16").validate()


def test_enums_travel_as_their_strings_in_the_assignment() -> None:
    config = TrainConfig(schedule="1f1b", dp_mode="allreduce", dtype="bf16")
    assert (config.schedule, config.dp_mode, config.dtype) == (
        Schedule.ONE_F_ONE_B, DpMode.ALLREDUCE, Dtype.BF16)
    msg = config.to_proto()
    assert (msg.schedule, msg.dp_mode, msg.dtype) == ("1f1b", "allreduce", "bf16")
    back = TrainConfig.from_proto(type(msg).FromString(msg.SerializeToString()))
    assert back == config and back.schedule is Schedule.ONE_F_ONE_B
    # A value no member has (a newer or broken peer) reaches validate, which names the flag.
    msg.schedule = "zigzag"
    with pytest.raises(ValueError, match="--schedule must be one of gpipe, 1f1b, got 'zigzag'"):
        TrainConfig.from_proto(msg).validate()


@pytest.mark.parametrize(("batch", "micro", "replicas"), [(6, 2, 2), (8, 3, 1), (9, 1, 2)])
def test_the_batch_rule_names_the_flags_and_a_fix(batch: int, micro: int, replicas: int) -> None:
    with pytest.raises(ValueError, match="--batch .* does not split evenly") as caught:
        TrainConfig(global_batch=batch, micro_batches=micro).validate(replicas)
    suggestion = int(str(caught.value).rsplit(" ", 1)[-1])
    TrainConfig(global_batch=suggestion, micro_batches=micro).validate(replicas)


def _listen_cli() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """A command like the daemons': `start --listen --agents`, its handler validating both."""

    parser = flags.Parser(prog="demo")
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start")
    flags.add_common_args(start)
    start.add_argument("--listen", default="127.0.0.1:7070")
    start.add_argument("--agents", type=flags.count, default=0)
    return parser, {"start": start}


def _error(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    from dtfm.rpc import split_hostport

    def handler(args: argparse.Namespace) -> int:
        split_hostport(args.listen, "--listen")
        if args.agents > 2:
            raise ConfigError(f"--min-agents 3 exceeds --agents {args.agents}; pick another "
                              f"--listen-port")
        return 0

    parser, subs = _listen_cli()
    assert flags.dispatch(parser, subs, argv, {"start": handler}) == 2
    return capsys.readouterr().err.strip()


def test_an_error_names_the_variable_or_file_key_a_bad_value_came_from(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """issue 31: DTFM_LISTEN=bad was reported as `--listen 'bad'`, a flag nobody typed."""
    monkeypatch.setenv("DTFM_LISTEN", "bad")
    assert _error(["start"], capsys) == (
        "error: $DTFM_LISTEN (--listen) 'bad' is not HOST:PORT (for example 127.0.0.1:7070)")
    # given on the command line, the flag itself (abbreviated or not) is what to fix
    for argv in (["start", "--listen", "worse"], ["start", "--lis=worse"]):
        assert _error(argv, capsys).startswith("error: --listen 'worse' is not HOST:PORT")
    monkeypatch.delenv("DTFM_LISTEN")
    toml = tmp_path / "c.toml"
    toml.write_text('listen = "bad"\n')
    assert _error(["start", "--config", str(toml)], capsys).startswith(
        f"error: config file {toml}: listen (--listen) 'bad' is not HOST:PORT")
    # only the whole flag is renamed: --listen-port and --min-agents stay as they are
    monkeypatch.setenv("DTFM_AGENTS", "3")
    toml.write_text("")
    assert _error(["start", "--config", str(toml)], capsys) == (
        "error: --min-agents 3 exceeds $DTFM_AGENTS (--agents) 3; pick another --listen-port")


def test_a_directory_flag_naming_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    flags.check_directory(str(tmp_path / "new" / "deeper"), "--state-dir")  # created later
    flags.check_directory(str(tmp_path), "--state-dir")
    with pytest.raises(ConfigError, match=r"^--state-dir .*/file is a file; give a directory"):
        flags.check_directory(str(tmp_path / "file"), "--state-dir")
    with pytest.raises(ConfigError, match=r"^--state-dir .*/file/sub cannot be made: .*/file "
                       r"is a file"):
        flags.check_directory(str(tmp_path / "file" / "sub"), "--state-dir")


def test_the_parsers_table_holds_every_argument_argparse_has() -> None:
    """The layered config reads `Parser.arguments`, not argparse's private list of actions: the
    table must miss none (a group's, a mutually exclusive group's, -h) and sort each action as
    argparse's own class does."""
    kinds = {argparse._StoreAction: flags.STORE, argparse._StoreTrueAction: flags.STORE_TRUE,
             argparse._StoreFalseAction: flags.STORE_FALSE}
    for top, subs in (coordinator_parser(), agent_parser()):
        for name, parser in [("", top), *subs.items()]:
            table = flags.arguments_of(parser)
            assert [a.action for a in table] == parser._actions, name
            assert [a.kind for a in table] == [kinds.get(type(a.action), flags.OTHER)
                                              for a in table], name


def test_layered_config_refuses_a_parser_that_keeps_no_table() -> None:
    with pytest.raises(TypeError, match="dtfm.flags.Parser"):
        flags.layered_defaults(argparse.ArgumentParser(), [])
