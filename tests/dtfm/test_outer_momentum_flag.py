"""`--outer-momentum`: auto by default, 0.5 for rounds of up to 64 local steps (where DiLoCo's
0.9 overshoots) and 0.9 for longer ones; an explicit value is used as given, and a wrong
one is refused naming the flag. The worker applies `TrainConfig.outer_mu()`."""

from __future__ import annotations

import pytest

from agent.cli import build_parser as agent_parser
from coordinator.cli import build_parser as coordinator_parser
from dtfm import flags
from dtfm.core.spec import LONGEST_MEASURED_ROUND, OUTER_MOMENTUM_AUTO, TrainConfig
from dtfm.rpc import ConfigError
from protos.dtfm.v1 import common_pb2


@pytest.mark.parametrize(("every", "mu"), [(2, 0.5), (4, 0.5), (16, 0.5),
                                           (LONGEST_MEASURED_ROUND, 0.5),
                                           (LONGEST_MEASURED_ROUND + 1, 0.9), (500, 0.9)])
def test_auto_takes_half_for_measured_rounds_and_dilocos_momentum_past_them(every: int,
                                                                             mu: float) -> None:
    assert TrainConfig(sync_every=every).outer_mu() == mu
    assert TrainConfig(sync_every=every, outer_momentum=0.7).outer_mu() == 0.7


def test_the_flag_takes_auto_or_a_fraction_in_both_commands() -> None:
    for parser in (coordinator_parser()[1]["start"], agent_parser()[1]["local"]):
        assert flags.train_config_from_args(parser.parse_args([])).outer_momentum == \
            OUTER_MOMENTUM_AUTO
        got = flags.train_config_from_args(parser.parse_args(["--outer-momentum", "0.0"]))
        assert got.outer_momentum == 0.0 and got.outer_mu() == 0.0
        assert flags.train_config_from_args(parser.parse_args(
            ["--outer-momentum", "auto"])).outer_momentum == OUTER_MOMENTUM_AUTO
        for bad in ("1", "-0.1", "nan", "lots"):
            with pytest.raises(ConfigError, match="expected a number in \\[0, 1\\) or auto"):
                parser.parse_args(["--outer-momentum", bad])
    assert flags.train_argv(TrainConfig()) == []  # auto is the default: nothing to pass on
    assert flags.train_argv(TrainConfig(outer_momentum=0.9)) == ["--outer-momentum", "0.9"]


def test_auto_travels_on_the_wire_and_the_worker_resolves_it() -> None:
    msg = TrainConfig(sync_every=4).to_proto()
    back = TrainConfig.from_proto(common_pb2.TrainConfig.FromString(msg.SerializeToString()))
    back.validate()
    assert back.outer_momentum == OUTER_MOMENTUM_AUTO and back.outer_mu() == 0.5
    with pytest.raises(ValueError, match="--outer-momentum must be in \\[0, 1\\) or auto"):
        TrainConfig(sync_every=4, outer_momentum=1.5).validate()
