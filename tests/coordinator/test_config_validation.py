"""Careless configuration: every bad value from a flag, DTFM_* or TOML is refused the same way.

One line on stderr naming the flag (or the file key / variable) and exit status 2, never a
traceback and never a daemon that starts with a value that breaks it later.
"""

from __future__ import annotations

import math
import socket
import stat
from pathlib import Path

import pytest

from coordinator.daemon.config import CoordinatorConfig, JobConfig
from dtfm.core.spec import TrainConfig
from dtfm.rpc import ConfigError, Security
from tests.daemons import TOKEN, Daemons, free_port, wait_for

pytestmark = pytest.mark.timeout(120)

START = ("coordinator", "start", "--listen", "127.0.0.1:0")

FLAG_CASES = [
    (["--heartbeat-interval", "nan"], "--heartbeat-interval"),
    (["--heartbeat-interval", "-1"], "--heartbeat-interval"),
    (["--heartbeat-budget", "-1"], "--heartbeat-budget"),
    (["--liveness-timeout", "nan"], "--liveness-timeout"),
    (["--liveness-timeout", "-5"], "--liveness-timeout"),
    (["--evict-after", "inf"], "--evict-after"),
    (["--lr", "nan"], "--lr"),
    (["--lr", "-0.1"], "--lr"),
    (["--search-seconds", "nan"], "--search-seconds"),
    (["--search-seconds", "-1"], "--search-seconds"),
    (["--max-restarts", "-1"], "--max-restarts"),
    (["--checkpoint-every", "-10"], "--checkpoint-every"),
    (["--warmup-steps", "-1"], "--warmup-steps"),
    (["--stages", "-2", "--model", "gpt-tiny", "--agents", "4"], "--stages"),
    (["--steps", "ten"], "--steps"),
    (["--steps", str(2**40)], "--steps"),
    (["--dtype", "fp16"], "--dtype"),
    (["--drift-threshold", "nan"], "--drift-threshold"),
    (["--drift-threshold", "0"], "--drift-threshold"),
    (["--drift-window", "1"], "--drift-window"),
    (["--replan-margin", "0.5"], "--replan-margin"),
    (["--remeasure-probe-seconds", "0"], "--remeasure-probe-seconds"),
]

ENV_CASES = [
    ({"DTFM_LOG_LEVEL": "verbose"}, "DTFM_LOG_LEVEL"),
    ({"DTFM_DTYPE": "fp16"}, "DTFM_DTYPE"),
    ({"DTFM_HEARTBEAT_INTERVAL": "nan"}, "DTFM_HEARTBEAT_INTERVAL"),
    ({"DTFM_STAGES": "-2"}, "DTFM_STAGES"),
    ({"DTFM_NO_MEASURE": "maybe"}, "DTFM_NO_MEASURE"),
    ({"DTFM_TOKEN": "guess"}, "at least 16"),
    ({"DTFM_TOKEN": "abcdefghijklmnop\x1bqrstuvw"}, "control"),
]

TOML_CASES = [
    ('steps = "ten"\n', "steps"),
    ("heartbeat-interval = nan\n", "heartbeat-interval"),
    ("liveness-timeout = -1.0\n", "liveness-timeout"),
    ('lr = "0.001"\n', "lr"),
    ("max-restarts = 1.5\n", "max-restarts"),
    ("no-measure = 1\n", "no-measure"),
    ('dtype = "fp16"\n', "dtype"),
    ("[job]\nsteps = 1\n", "job"),
]


def _refused(out: object, mention: str) -> None:
    stderr = out.stderr.strip()  # type: ignore[attr-defined]
    assert out.returncode == 2, (out.returncode, stderr)  # type: ignore[attr-defined]
    assert "Traceback" not in stderr, stderr
    assert len(stderr.splitlines()) == 1, f"want one line, got:\n{stderr}"
    assert mention in stderr, stderr


@pytest.mark.parametrize(("extra", "flag"), FLAG_CASES)
def test_bad_flags_are_refused_naming_the_flag(daemons: Daemons, extra: list[str],
                                               flag: str) -> None:
    _refused(daemons.cli(*START, *extra, timeout=30), flag)


@pytest.mark.parametrize(("env", "mention"), ENV_CASES)
def test_bad_environment_is_refused_like_a_flag(daemons: Daemons, env: dict[str, str],
                                                mention: str) -> None:
    _refused(daemons.cli(*START, env=daemons.env(**env), timeout=30), mention)


@pytest.mark.parametrize(("text", "key"), TOML_CASES)
def test_bad_toml_is_refused_naming_file_and_key(daemons: Daemons, text: str, key: str) -> None:
    path = daemons.tmp / "bad.toml"
    path.write_text(text)
    out = daemons.cli(*START, "--config", str(path), timeout=30)
    _refused(out, key)
    assert str(path) in out.stderr


def test_other_commands_refuse_bad_values_too(daemons: Daemons) -> None:
    _refused(daemons.cli("coordinator", "status", "--timeout", "nan"), "--timeout")
    _refused(daemons.cli("agent", "local", "--stages", "0"), "--stages")
    _refused(daemons.cli("agent", "local", "--timeout", "nan"), "--timeout")
    _refused(daemons.cli("agent", "local", "--layer-splits", "3,x"), "--layer-splits")
    _refused(daemons.cli("agent", "start", "--advertise", "256.256.256.256"), "--advertise")
    _refused(daemons.cli("agent", "start", env=daemons.env(DTFM_DEVICE="tpu")), "DTFM_DEVICE")


def test_a_bad_value_from_the_environment_or_file_is_named_by_where_it_came_from(
        daemons: Daemons) -> None:
    """issue 31: DTFM_LISTEN=bad was reported as `--listen`, a flag nobody had typed."""
    for command in (START[:2], ("agent", "start")):
        _refused(daemons.cli(*command, env=daemons.env(DTFM_LISTEN="bad"), timeout=30),
                 "$DTFM_LISTEN (--listen) 'bad' is not HOST:PORT")
    path = daemons.tmp / "listen.toml"
    path.write_text('listen = "bad"\n')
    _refused(daemons.cli(*START[:2], "--config", str(path), timeout=30),
             f"config file {path}: listen (--listen) 'bad'")


def test_a_state_dir_that_is_a_file_is_one_line_naming_the_flag(daemons: Daemons) -> None:
    """issue 31: `coordinator start --state-dir FILE` ended in a traceback."""
    file = daemons.tmp / "not-a-dir"
    file.write_text("x")
    for command in (START, ("agent", "start")):
        _refused(daemons.cli(*command, "--state-dir", str(file), timeout=30),
                 f"--state-dir {file} is a file; give a directory")
        _refused(daemons.cli(*command, "--state-dir", str(file / "sub"), timeout=30),
                 f"--state-dir {file / 'sub'} cannot be made: {file} is a file")
        _refused(daemons.cli(*command, env=daemons.env(DTFM_STATE_DIR=str(file)), timeout=30),
                 f"$DTFM_STATE_DIR (--state-dir) {file} is a file")


def test_a_port_in_use_is_a_clear_error(daemons: Daemons) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = daemons.cli("coordinator", "start", "--listen", f"127.0.0.1:{port}", timeout=30)
        _refused(out, "in use")
        out = daemons.cli("agent", "start", "--listen", f"127.0.0.1:{port}", "--state-dir",
                          str(daemons.tmp / "a"), "--device", "cpu", timeout=30)
        _refused(out, "in use")
    # A second coordinator on a live one's port must not quietly share it (SO_REUSEPORT).
    _, address = daemons.coordinator()
    out = daemons.cli("coordinator", "start", "--listen", address, timeout=30)
    _refused(out, "in use")


def test_token_file_rules(daemons: Daemons) -> None:
    target = ("coordinator", "status", "--coordinator", f"127.0.0.1:{free_port()}",
              "--timeout", "1")
    env = {k: v for k, v in daemons.env().items() if k != "DTFM_TOKEN"}
    path = daemons.tmp / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o644)
    out = daemons.cli(*target, "--token-file", str(path), env=env)
    assert out.returncode == 1 and "readable by others" in out.stderr and "chmod 600" in out.stderr
    path.chmod(0o640)
    out = daemons.cli(*target, "--token-file", str(path), env=env)
    assert out.returncode == 1 and "readable by its group" in out.stderr, out.stderr
    path.chmod(0o600)
    out = daemons.cli(*target, "--token-file", str(path), env=env)
    assert out.returncode == 1 and "readable" not in out.stderr, out.stderr
    path.write_text("first-half-of-it\nsecond-half-of-it\n")
    out = daemons.cli(*target, "--token-file", str(path), env=env)
    _refused(out, "control")
    assert "first-half" not in out.stderr  # the message never shows the token


def test_demo_style_token_is_accepted(daemons: Daemons) -> None:
    import secrets

    Security(token=secrets.token_hex(16)).validate()
    proc, _ = daemons.coordinator(env=daemons.env(DTFM_TOKEN=secrets.token_hex(16)))
    assert proc.poll() is None


def test_config_objects_validate_programmatic_values() -> None:
    good = Security(token=TOKEN)
    for kwargs in ({"heartbeat_interval_s": math.nan}, {"liveness_timeout_s": math.nan},
                   {"evict_after_s": -1.0}, {"measure_every_s": math.inf}):
        with pytest.raises(ConfigError):
            CoordinatorConfig(security=good, **kwargs).validate()  # type: ignore[arg-type]
    for kwargs in ({"stages": -2}, {"search_seconds": math.nan}, {"max_restarts": -1}):
        with pytest.raises(ConfigError):
            JobConfig(**kwargs).validate()  # type: ignore[arg-type]
    for kwargs in ({"dtype": "fp16"}, {"lr": math.nan}, {"warmup_steps": -1},
                   {"checkpoint_every": -1}, {"steps": 2**33}, {"grad_clip": math.inf}):
        with pytest.raises(ValueError):
            TrainConfig(**kwargs).validate()  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="at least 16"):
        Security(token="x" * 15).validate()


def test_agent_state_dir_and_id_are_private(daemons: Daemons, tmp_path: Path) -> None:
    import os

    state = tmp_path / "agent-state"
    state.mkdir(mode=0o755)
    state.chmod(0o755)
    _, address = daemons.coordinator()
    old = os.umask(0o022)
    try:
        daemons.agent(address, "agent-state")
    finally:
        os.umask(old)
    wait_for(lambda: (state / "agent-id").exists(), 30, "the agent id file")
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert stat.S_IMODE((state / "agent-id").stat().st_mode) == 0o600


def test_state_files_are_private_whatever_the_umask(tmp_path: Path) -> None:
    import os

    from agent.daemon.statedir import private_dir
    from dtfm.core.files import open_private_append, write_private

    old = os.umask(0)
    try:
        work = private_dir(tmp_path / "state" / "work")
        write_private(work / "job.assignment.pb", b"x")
        with open_private_append(work / "job.log") as log:
            log.write(b"line\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE(work.stat().st_mode) == 0o700
    for name in ("job.assignment.pb", "job.log"):
        assert stat.S_IMODE((work / name).stat().st_mode) == 0o600, name


def test_units_keep_state_private() -> None:
    deploy = Path(__file__).resolve().parents[2] / "deploy"
    for unit in ("dtfm-coordinator.service", "dtfm-agent@.service"):
        text = (deploy / unit).read_text()
        assert "\nUMask=0077\n" in text and "\nStateDirectoryMode=0700\n" in text, unit


def test_data_prepared_for_a_larger_vocabulary_is_refused_before_any_worker(
        tmp_path: Path) -> None:
    from dtfm.core.tokenfiles import TokenMeta, write_meta

    write_meta(tmp_path, TokenMeta(
        dtype="uint16", vocab_size=300, tokenizer_hash="ab" * 32, eot_id=0, eot_token="</s>",
        max_token_id=299, documents={"train": 9, "val": 1}, tokens={"train": 900, "val": 100},
        val_fraction=0.1))
    job = JobConfig(model="gpt-tiny", agents=1, train=TrainConfig(data_path=str(tmp_path)))
    with pytest.raises(ConfigError, match=f"--data {tmp_path} holds token id 299 but the "
                                          f"model's vocabulary is 256"):
        job.validate()
    JobConfig(model="gpt-125m", agents=1, train=TrainConfig(data_path=str(tmp_path))).validate()
    # a path the coordinator's disk does not hold is the agents' to check
    JobConfig(model="gpt-tiny", agents=1,
              train=TrainConfig(data_path=str(tmp_path / "on-the-agents"))).validate()
