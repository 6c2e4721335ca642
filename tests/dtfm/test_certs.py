"""`dtfm.certs`: the CA and node certificates `coordinator certs` writes, and its refusals."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from dtfm import certs


def _sans(cert: x509.Certificate) -> tuple[list[str], list[str]]:
    value = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return (value.get_values_for_type(x509.DNSName),
            [str(ip) for ip in value.get_values_for_type(x509.IPAddress)])


def test_node_certificate_names_every_address_and_serves_both_ends(tmp_path: Path) -> None:
    ca = certs.new_ca()
    node = certs.new_node(ca, "gpu-box-1.example.org",
                          ["10.0.0.5", "gpu1", "203.0.113.7:7071", "[fd00::1]:7071", "10.0.0.5"])
    node.cert.verify_directly_issued_by(ca.cert)
    dns, ips = _sans(node.cert)
    assert dns == ["gpu-box-1.example.org", "gpu1"]
    assert ips == ["10.0.0.5", "203.0.113.7", "fd00::1"]  # each once, ports dropped
    usage = node.cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usage)
    assert not node.cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert ca.cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_keys_are_0600_whatever_the_umask_and_nothing_is_overwritten(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        cert, key = certs.write_ca(tmp_path / "ca", certs.new_ca())
    finally:
        os.umask(old)
    assert key.stat().st_mode & 0o777 == 0o600
    assert cert.stat().st_mode & 0o777 == 0o644
    before = key.read_bytes()
    with pytest.raises(certs.CertError, match="already exist.*--force"):
        certs.write_ca(tmp_path / "ca", certs.new_ca())
    assert key.read_bytes() == before
    certs.write_ca(tmp_path / "ca", certs.new_ca(), force=True)
    assert key.read_bytes() != before and key.stat().st_mode & 0o777 == 0o600
    loaded = certs.load_ca(tmp_path / "ca")
    assert loaded.cert.public_key() == loaded.key.public_key()


@pytest.mark.parametrize(("name", "message"), [
    ("10.0.0.300", "'10.0.0.300' is not a valid IP address"),
    ("1.2.3", "not a valid IP address"),
    ("fd00::zz", "not a valid IP address"),
    ("a b", "'a b' is not a valid host name"),
    ("-bad.example.org", "not a valid host name"),
    ("", "not a valid IP address"),
])
def test_a_bad_address_is_refused_naming_it_and_the_flag(name: str, message: str) -> None:
    with pytest.raises(certs.CertError, match=message) as caught:
        certs.new_node(certs.new_ca(), "node.example.org", [name])
    assert "--advertise" in str(caught.value)


def test_a_wildcard_and_an_ipv6_address_are_accepted() -> None:
    assert certs.subject_alt_name("*.gpus.example.org") == x509.DNSName("*.gpus.example.org")
    assert certs.subject_alt_name("::1") == x509.IPAddress(ipaddress.ip_address("::1"))


def test_missing_or_mismatched_ca_files_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(certs.CertError, match="is not a directory.*coordinator certs ca"):
        certs.load_ca(tmp_path / "nowhere")
    certs.write_ca(tmp_path, certs.new_ca())
    (tmp_path / "ca.key").unlink()
    with pytest.raises(certs.CertError, match="has no ca.key"):
        certs.load_ca(tmp_path)
    certs.write(certs.new_ca(), tmp_path / "other.pem", tmp_path / "ca.key")
    with pytest.raises(certs.CertError, match="ca.key is not the key of .*ca.pem"):
        certs.load_ca(tmp_path)
    (tmp_path / "ca.key").write_text("garbage")
    with pytest.raises(certs.CertError, match="cannot read the CA"):
        certs.load_ca(tmp_path)


def test_days_out_of_range_are_refused() -> None:
    with pytest.raises(certs.CertError, match="--days 0"):
        certs.new_ca(days=0)
