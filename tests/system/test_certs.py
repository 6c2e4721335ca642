"""`coordinator certs` as an operator runs it: its files carry a real coordinator and agent
over mutual TLS, the names it signs are the ones TLS checks, and bad input is a clear refusal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cryptography import x509

from tests.daemons import Daemons, wait_for

pytestmark = pytest.mark.timeout(120)


def _certs(daemons: Daemons, *args: str) -> str:
    out = daemons.cli("coordinator", "certs", *args)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _tls(directory: Path) -> list[str]:
    return ["--tls-cert", str(directory / "node.pem"), "--tls-key", str(directory / "node.key"),
            "--tls-ca", str(directory / "ca.pem")]


def test_generated_certificates_carry_a_coordinator_and_an_agent_over_mtls(
        daemons: Daemons) -> None:
    tmp = daemons.tmp
    _certs(daemons, "ca", "--out", str(tmp / "ca"))
    said = _certs(daemons, "node", "--ca-dir", str(tmp / "ca"), "--out", str(tmp / "coord"),
                  "--name", "localhost", "--advertise", "127.0.0.1")
    assert "127.0.0.1" in said and str(tmp / "coord" / "node.key") in said
    _certs(daemons, "node", "--ca-dir", str(tmp / "ca"), "--out", str(tmp / "agent"),
           "--name", "agent-1.test", "--advertise", "127.0.0.1")
    for key in (tmp / "ca/ca.key", tmp / "coord/node.key", tmp / "agent/node.key"):
        assert key.stat().st_mode & 0o777 == 0o600, key
    node = x509.load_pem_x509_certificate((tmp / "agent/node.pem").read_bytes())
    sans = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["agent-1.test"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]

    # the coordinator demands client certificates; the agent serves and dials with its own
    _, address = daemons.coordinator(*_tls(tmp / "coord"))
    daemons.agent(address, "agent-1", *_tls(tmp / "agent"))

    def joined() -> list[dict]:
        out = daemons.cli("coordinator", "status", "--coordinator", address, "--json",
                          *_tls(tmp / "coord"))
        assert out.returncode == 0, out.stderr
        return [a for a in json.loads(out.stdout)["agents"] if a["state"] == "alive"]

    agent = wait_for(joined, 30, "the agent to join over mutual TLS")[0]
    status = daemons.cli("agent", "status", "--agent", agent["address"], "--json",
                         *_tls(tmp / "coord"))
    assert status.returncode == 0 and json.loads(status.stdout)["connected"], status.stderr
    no_cert = daemons.cli("coordinator", "status", "--coordinator", address, "--tls-ca",
                          str(tmp / "ca/ca.pem"), "--timeout", "3")
    assert no_cert.returncode == 1, "a client without a certificate must be refused"

    # a certificate that does not name the address it is dialled at is refused by TLS
    _certs(daemons, "node", "--ca-dir", str(tmp / "ca"), "--out", str(tmp / "far"),
           "--name", "far-away.test", "--advertise", "10.9.9.9")
    _, far = daemons.coordinator(*_tls(tmp / "far"))
    wrong_name = daemons.cli("coordinator", "status", "--coordinator", far, "--timeout", "3",
                             *_tls(tmp / "coord"))
    assert wrong_name.returncode == 1, "TLS must check the SANs against the address dialled"


def test_bad_input_is_a_clear_refusal(daemons: Daemons) -> None:
    tmp = daemons.tmp

    def refused(*args: str) -> str:
        out = daemons.cli("coordinator", "certs", *args)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        return out.stderr

    assert "--ca-dir" in refused("node", "--ca-dir", str(tmp / "missing"), "--out", str(tmp / "n"),
                                 "--name", "a.test")
    assert "coordinator certs ca --out" in refused(
        "node", "--ca-dir", str(tmp / "missing"), "--out", str(tmp / "n"), "--name", "a.test")
    _certs(daemons, "ca", "--out", str(tmp / "ca"))
    bad_ip = refused("node", "--ca-dir", str(tmp / "ca"), "--out", str(tmp / "n"), "--name",
                     "a.test", "--advertise", "10.0.0.300")
    assert "'10.0.0.300' is not a valid IP address" in bad_ip and "--advertise" in bad_ip
    assert not (tmp / "n").exists(), "nothing is written for a refused request"
    again = refused("ca", "--out", str(tmp / "ca"))
    assert "already exist" in again and "--force" in again
    _certs(daemons, "ca", "--out", str(tmp / "ca"), "--force")
