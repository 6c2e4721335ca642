"""`--moments-dtype`: one TrainConfig field, one flag in every command that trains, one wire
field; an older peer's unset field reads as fp32, and a wrong value is refused naming the flag.
"""

from __future__ import annotations

import pytest

from agent.cli import build_parser as agent_parser
from coordinator.cli import build_parser as coordinator_parser
from dtfm import flags
from dtfm.core.spec import MomentsDtype, TrainConfig
from dtfm.rpc import ConfigError
from protos.dtfm.v1 import common_pb2


def test_the_flag_sets_the_field_in_both_commands_and_defaults_to_fp32() -> None:
    for parser in (coordinator_parser()[1]["start"], agent_parser()[1]["local"]):
        assert flags.train_config_from_args(parser.parse_args([])).moments_dtype \
            is MomentsDtype.FP32
        got = flags.train_config_from_args(parser.parse_args(["--moments-dtype", "bf16"]))
        assert got.moments_dtype is MomentsDtype.BF16
        with pytest.raises(ConfigError, match="--moments-dtype.*'fp16'.*'fp32', 'bf16'"):
            parser.parse_args(["--moments-dtype", "fp16"])
    assert flags.train_argv(TrainConfig(moments_dtype="bf16")) == ["--moments-dtype", "bf16"]


def test_the_environment_reaches_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTFM_MOMENTS_DTYPE", "bf16")
    parser = coordinator_parser()[1]["start"]
    flags.layered_defaults(parser, [])
    assert flags.train_config_from_args(parser.parse_args([])).moments_dtype == "bf16"


def test_it_travels_on_the_wire_and_an_older_peers_unset_field_is_fp32() -> None:
    msg = TrainConfig(moments_dtype="bf16").to_proto()
    assert msg.moments_dtype == "bf16"
    back = TrainConfig.from_proto(common_pb2.TrainConfig.FromString(msg.SerializeToString()))
    assert back.moments_dtype is MomentsDtype.BF16
    older = TrainConfig().to_proto()
    older.ClearField("moments_dtype")  # what a coordinator from before the field sends
    assert TrainConfig.from_proto(older).moments_dtype is MomentsDtype.FP32
    TrainConfig.from_proto(older).validate()


def test_a_value_no_member_has_is_refused_by_validate_naming_the_flag() -> None:
    msg = TrainConfig().to_proto()
    msg.moments_dtype = "int8"
    with pytest.raises(ValueError, match="--moments-dtype must be one of fp32, bf16, got 'int8'"):
        TrainConfig.from_proto(msg).validate()
