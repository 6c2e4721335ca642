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
