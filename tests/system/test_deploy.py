"""The deploy files speak the CLIs' language: every setting they name is a real flag."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from agent.cli import build_parser as agent_parser
from coordinator.cli import build_parser as coordinator_parser
from dtfm.flags import layered_defaults

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _dests(parser: object) -> set[str]:
    return {a.dest for a in parser._actions}  # type: ignore[attr-defined]


def _env_keys(path: Path) -> set[str]:
    keys = set()
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key = line.split("=", 1)[0]
            assert key.startswith("DTFM_"), f"{path.name}: {key} is not a DTFM_ setting"
            keys.add(key.removeprefix("DTFM_").lower())
    return keys


@pytest.mark.parametrize(("env_file", "build", "command"), [
    ("coordinator.env", coordinator_parser, "start"),
    ("agent.env", agent_parser, "start"),
    ("agent-0.env", agent_parser, "start"),
])
def test_env_files_name_real_flags(env_file: str, build: object, command: str) -> None:
    _, subs = build()  # type: ignore[operator]
    unknown = _env_keys(DEPLOY / env_file) - _dests(subs[command])
    assert not unknown, f"{env_file} sets unknown flags: {unknown}"


def test_units_run_the_project_entry_points_with_their_env_files() -> None:
    coordinator = (DEPLOY / "dtfm-coordinator.service").read_text()
    agent = (DEPLOY / "dtfm-agent@.service").read_text()
    assert re.search(r"^ExecStart=/opt/dtfm/venv/bin/coordinator start$", coordinator, re.M)
    assert re.search(r"^ExecStart=/opt/dtfm/venv/bin/agent start$", agent, re.M)
    assert "EnvironmentFile=/etc/dtfm/coordinator.env" in coordinator
    assert "EnvironmentFile=/etc/dtfm/agent.env" in agent
    assert "DTFM_STATE_DIR=/var/lib/dtfm/agent-%i" in agent
    _, subs = agent_parser()
    assert "state_dir" in _dests(subs["start"])


def test_example_toml_is_accepted_by_the_coordinator(tmp_path: Path) -> None:
    _, subs = coordinator_parser()
    parser = subs["start"]
    layered_defaults(parser, ["--config", str(DEPLOY / "coordinator.example.toml")])
    args = parser.parse_args(["--config", str(DEPLOY / "coordinator.example.toml")])
    assert args.model == "gpt-1.3b" and args.agents == 64 and args.micro_batches == 8


def test_install_script_parses_and_refuses_bad_usage(tmp_path: Path) -> None:
    script = DEPLOY / "install.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    for args in (["bogus"], ["agent", "0", "--bogus"], ["coordinator", "0"],
                 ["agent", "x1"], ["agent", "0", "--advertise"]):
        out = subprocess.run(["bash", str(script), *args], capture_output=True, text=True,
                             env={"PATH": "/usr/bin:/bin", "DESTDIR": str(tmp_path)})
        assert out.returncode == 2 and "usage" in out.stderr, (args, out.stderr)
    for env, message in ((dict(PREFIX="opt/dtfm"), "must be an absolute path"),
                         (dict(PREFIX="/opt/my dtfm"), "may not hold spaces")):
        out = subprocess.run(["bash", str(script), "coordinator"], capture_output=True,
                             text=True, env={"PATH": "/usr/bin:/bin", "DESTDIR": str(tmp_path),
                                             **env})
        assert out.returncode == 2 and message in out.stderr, (env, out.stderr)
    assert list(tmp_path.iterdir()) == [], "a refused install writes nothing"


def test_units_raise_the_open_files_limit_for_a_thousand_agents() -> None:
    """systemd's default soft limit (1,024) is what idle connections exhausted (issue 41);
    the units' comments and docs/operations.md, "Open files", hold the arithmetic."""
    for unit in ("dtfm-coordinator.service", "dtfm-agent@.service"):
        limits = re.findall(r"^LimitNOFILE=(\d+)$", (DEPLOY / unit).read_text(), re.M)
        assert limits and int(limits[0]) >= 22_000 * 2, f"{unit}: LimitNOFILE={limits}"


def test_sysctl_file_sets_real_keys_to_well_formed_values() -> None:
    conf = DEPLOY / "sysctl.d" / "60-dtfm-wan.conf"
    settings = {}
    for line in conf.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            settings[key.strip()] = [int(v) for v in value.split()]
    assert settings, "no settings"
    for key, values in settings.items():
        assert Path("/proc/sys", *key.split(".")).exists(), f"{key} is not a kernel setting"
        if key.endswith(("tcp_rmem", "tcp_wmem")):
            low, default, high = values
            assert low <= default <= high
            core = settings["net.core." + ("rmem_max" if "rmem" in key else "wmem_max")]
            assert high <= core[0], f"{key}: max above the net.core cap"
    # one stream can fill 1 Gbit/s over the longest round trip of the paper's world matrix
    assert settings["net.ipv4.tcp_rmem"][2] >= 1e9 / 8 * 0.476
