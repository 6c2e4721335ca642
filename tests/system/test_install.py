"""`deploy/install.sh` as an operator runs it, staged under a temporary DESTDIR.

It runs twice per role (an upgrade must keep the token and the operator's env files), every
installed unit passes `systemd-analyze verify`, and the installed `coordinator` and `agent`
entry points start from the installed env files (with their paths moved under DESTDIR and
loopback addresses) and find each other.

To stay fast the test does not download torch and the other dependencies: the install runs
with PYTHONPATH naming this checkout's venv, so pip finds them already there. The `dtfm`
package itself is built and installed from the staged copy of the source, and the daemons
import it from the installed venv (checked below).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import pytest
from cryptography import x509

from dtfm import certs
from dtfm.procs import terminate_all
from tests.daemons import free_port, wait_for

# four installs (venv + pip) and two daemons: minutes on a loaded machine
pytestmark = pytest.mark.timeout(900)
REPO = Path(__file__).resolve().parents[2]
STAGED = ("/etc/dtfm", "/var/lib/dtfm", "/opt/dtfm")
UNITS = ("dtfm-coordinator.service", "dtfm-agent@.service")


def _install_env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTFM_")}
    paths = sysconfig.get_paths()
    env.update(DESTDIR=str(root), PYTHON=sys._base_executable,  # type: ignore[attr-defined]
               PYTHONPATH=os.pathsep.join(dict.fromkeys([paths["purelib"], paths["platlib"]])),
               PIP_DISABLE_PIP_VERSION_CHECK="1",
               PIP_NO_BUILD_ISOLATION="0")  # (sic) build with the setuptools found there

    return env


def _install(root: Path, *role: str) -> str:
    out = subprocess.run(["bash", str(REPO / "deploy" / "install.sh"), *role],
                         env=_install_env(root), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"install.sh {' '.join(role)} failed:\n{out.stdout}{out.stderr}"
    return out.stdout + out.stderr


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Install both roles, note what an upgrade must keep, edit an env file, install again."""
    root = tmp_path_factory.mktemp("destdir")
    _install(root, "coordinator", "--make-certs", "--advertise", "coordinator.test")
    _install(root, "agent", "0")
    etc = root / "etc" / "dtfm"
    first = {"token": (etc / "token").read_text(), "agent-0": (etc / "agent-0.env").read_text(),
             "operator-token": (etc / "operator-token").read_text(),
             **{f.name: f.read_bytes() for f in (etc / "tls").iterdir()}}
    with open(etc / "coordinator.env", "a") as f:
        f.write("# edited by the operator\n")
    again = _install(root, "coordinator", "--make-certs")
    _install(root, "agent", "0")
    return {"root": root, "first": first, "again": again}


def test_install_twice_keeps_token_and_env_files(staged: dict) -> None:
    root: Path = staged["root"]
    etc = root / "etc" / "dtfm"
    assert (etc / "token").read_text() == staged["first"]["token"]
    assert len(staged["first"]["token"].strip()) >= 40
    assert (etc / "token").stat().st_mode & 0o777 == 0o600
    operator = etc / "operator-token"  # the coordinator's alone: submit, cancel, admit
    assert operator.read_text() == staged["first"]["operator-token"] != staged["first"]["token"]
    assert len(operator.read_text().strip()) >= 40 and operator.stat().st_mode & 0o777 == 0o600
    assert "DTFM_OPERATOR_TOKEN_FILE=/etc/dtfm/operator-token" in (
        etc / "coordinator.env").read_text()
    assert "does not name the operator token" not in staged["again"]
    assert "# edited by the operator" in (etc / "coordinator.env").read_text()
    assert (etc / "agent-0.env").read_text() == staged["first"]["agent-0"]
    for unit in UNITS:  # as shipped, but running the venv the installer built
        shipped = (REPO / "deploy" / unit).read_text()
        assert "/opt/dtfm/venv/bin/" in shipped
        assert (root / "etc/systemd/system" / unit).read_text() == \
            shipped.replace("/opt/dtfm/", f"{root}/opt/dtfm/")
    for name in ("ca.pem", "ca.key", "node.pem", "node.key"):
        assert (etc / "tls" / name).read_bytes() == staged["first"][name], f"{name} replaced"
    assert "kept" in staged["again"] and "node.pem" in staged["again"]
    src = root / "opt/dtfm/src"
    assert (src / "docs/operations.md").exists() and not (src / ".venv").exists()


def test_installed_units_pass_systemd_analyze_verify(staged: dict, tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    units = staged["root"] / "etc/systemd/system"
    # the staged units as the installer wrote them; an instance is the template's text
    shutil.copy(units / "dtfm-agent@.service", tmp_path / "dtfm-agent@0.service")
    for unit in (units / "dtfm-coordinator.service", units / "dtfm-agent@.service",
                 tmp_path / "dtfm-agent@0.service"):
        out = subprocess.run([tool, "verify", str(unit)], capture_output=True,
                             text=True, timeout=60, cwd=tmp_path)
        assert out.returncode == 0 and not out.stderr.strip(), \
            f"systemd-analyze verify {unit}:\n{out.stdout}{out.stderr}"


def test_make_certs_writes_the_tls_files_the_env_files_name(staged: dict) -> None:
    tls = staged["root"] / "etc/dtfm/tls"
    assert {f.name for f in tls.iterdir()} == {"ca.pem", "ca.key", "node.pem", "node.key"}
    for key in ("ca.key", "node.key"):
        assert (tls / key).stat().st_mode & 0o777 == 0o600, key
    ca = certs.load_ca(tls)
    node = x509.load_pem_x509_certificate((tls / "node.pem").read_bytes())
    node.verify_directly_issued_by(ca.cert)
    sans = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "coordinator.test" in sans.get_values_for_type(x509.DNSName)
    assert "127.0.0.1" in {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    for line in (staged["root"] / "etc/dtfm/coordinator.env").read_text().splitlines():
        if line.startswith("DTFM_TLS_"):
            assert (staged["root"] / line.partition("=")[2].lstrip("/")).is_file(), line


def _env_file(path: Path, root: Path) -> dict[str, str]:
    """KEY=VALUE lines as systemd's EnvironmentFile= reads them, paths moved under `root`."""
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = f"{root}{value}" if value.startswith(STAGED) else value
    return env


def _unit_env(unit: Path, instance: str, root: Path) -> dict[str, str]:
    """The unit's own `Environment=` settings for one instance."""
    env = {}
    for line in unit.read_text().splitlines():
        if line.startswith("Environment="):
            key, _, value = line.removeprefix("Environment=").replace("%i", instance).partition(
                "=")
            env[key] = f"{root}{value}" if value.startswith(STAGED) else value
    return env


def test_installed_entry_points_run_from_the_env_files(staged: dict) -> None:
    root: Path = staged["root"]
    bin_dir, etc = root / "opt/dtfm/venv/bin", root / "etc/dtfm"
    base = {k: v for k, v in os.environ.items() if not k.startswith("DTFM_")}
    base["PYTHONPATH"] = _install_env(root)["PYTHONPATH"]
    where = subprocess.run([str(bin_dir / "python"), "-c", "import coordinator, agent; "
                            "print(coordinator.__file__, agent.__file__)"], env=base,
                           capture_output=True, text=True, timeout=30, cwd=root)
    assert where.stdout.count(str(root / "opt/dtfm/venv")) == 2, where.stdout + where.stderr
    address = f"127.0.0.1:{free_port()}"
    metrics = f"127.0.0.1:{free_port()}"
    coordinator_env = {**base, **_env_file(etc / "coordinator.env", root), "DTFM_LISTEN": address,
                       "DTFM_METRICS_LISTEN": metrics}
    agent_env = {**base, **_env_file(etc / "agent.env", root),
                 **_env_file(etc / "agent-0.env", root),
                 **_unit_env(root / "etc/systemd/system/dtfm-agent@.service", "0", root),
                 "DTFM_COORDINATOR": address, "DTFM_LISTEN": "127.0.0.1:0",
                 "DTFM_ADVERTISE": "127.0.0.1", "DTFM_DEVICE": "cpu"}
    logs = root / "logs"
    logs.mkdir(exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for name, env in (("coordinator", coordinator_env), ("agent", agent_env)):
            with open(logs / f"{name}.log", "wb") as log:
                procs.append(subprocess.Popen([str(bin_dir / name), "start"], env=env,
                                              stdout=log, stderr=subprocess.STDOUT, cwd=root,
                                              start_new_session=True))
            time.sleep(0.5 if name == "coordinator" else 0)

        def alive() -> list[dict]:
            for proc, name in zip(procs, ("coordinator", "agent"), strict=True):
                assert proc.poll() is None, (logs / f"{name}.log").read_text()
            out = subprocess.run([str(bin_dir / "coordinator"), "status", "--coordinator",
                                  address, "--json"], env=coordinator_env, capture_output=True,
                                 text=True, timeout=30, cwd=root)
            if out.returncode != 0:
                return []
            return [a for a in json.loads(out.stdout)["agents"] if a["state"] == "alive"]

        agents = wait_for(alive, 30, "the installed agent to join the installed coordinator")
        assert agents[0]["address"].startswith("127.0.0.1:")
        assert (root / "var/lib/dtfm/agent-0").is_dir()  # the unit's DTFM_STATE_DIR
        with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5) as reply:
            assert b'dtfm_cluster_agents{state="alive"} 1.0' in reply.read()
        # the env file names the operator token: the join token alone may not cancel
        for env, answer in (({k: v for k, v in coordinator_env.items()
                              if k != "DTFM_OPERATOR_TOKEN_FILE"}, "PERMISSION_DENIED"),
                            (coordinator_env, "NOT_FOUND")):
            out = subprocess.run([str(bin_dir / "coordinator"), "cancel", "job-none",
                                  "--coordinator", address], env=env, capture_output=True,
                                 text=True, timeout=30, cwd=root)
            assert out.returncode == 1 and answer in out.stderr, out.stderr
    finally:
        terminate_all(procs)
    assert [p.returncode for p in procs] == [0, 0], [
        (logs / f"{n}.log").read_text()[-2000:] for n in ("coordinator", "agent")]
