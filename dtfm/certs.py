"""A cluster's own certificate authority and the node certificates it signs.

Owns making a CA (`ca.pem` + `ca.key`), signing a node's certificate (`node.pem` +
`node.key`) with subject alternative names from its host names and addresses, and writing
them: key files `0600` whatever the umask, nothing overwritten unless asked. Why here: the
`coordinator certs` command (coordinator/commands/certs.py), `deploy/install.sh --make-certs`
and the tests' throwaway CAs (tests/certs.py) share one implementation, and the daemons' TLS
(`dtfm.rpc`) accepts exactly what it makes: one certificate per node with both `serverAuth`
and `clientAuth`, so mutual TLS works in both directions (an agent serves and dials with it).
No daemon logic: files in, files out.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dtfm.core.files import write_private

CA_CERT, CA_KEY = "ca.pem", "ca.key"
NODE_CERT, NODE_KEY = "node.pem", "node.key"
CA_DAYS = 3650  # a CA outlives its nodes: re-signing nodes is cheap, replacing a CA is not
NODE_DAYS = 825
MAX_DAYS = 36500
PUBLIC_MODE = 0o644
BACKDATE = datetime.timedelta(minutes=5)  # tolerate clocks a little behind the signer's
# RFC 1123 labels; a leading `*.` wildcard is allowed as certificate SANs allow it
_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


class CertError(ValueError):
    """A bad input or file, with what was wrong and what to do."""


@dataclass(frozen=True)
class Signed:
    """A private key and the certificate for it."""

    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate


def subject_alt_name(text: str) -> x509.GeneralName:
    """One SAN: an IP address as an IP SAN, a host name as a DNS SAN; `HOST:PORT` or
    `[V6]:PORT` (as `--advertise` and `--listen` may be written) loses its port."""
    host = text.strip()
    bracketed = re.fullmatch(r"\[([^\]]+)\](?::\d+)?", host)
    if bracketed:
        host = bracketed.group(1)
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    if not host or re.fullmatch(r"[0-9.]+", host) or ":" in host:
        raise CertError(f"{text!r} is not a valid IP address (IPv4 like 10.0.0.5, IPv6 like "
                        "fd00::5) nor a host name: fix it in --advertise or --name")
    labels = host.rstrip(".").split(".")
    if labels[0] == "*":
        labels = labels[1:]
    if len(host) > 253 or not labels or not all(_LABEL.match(label) for label in labels):
        raise CertError(f"{text!r} is not a valid host name (letters, digits and '-' in "
                        "dot-separated labels of at most 63) nor an IP address: fix it in "
                        "--advertise or --name")
    return x509.DNSName(host.rstrip(".").lower())


def subject_alt_names(names: Iterable[str]) -> list[x509.GeneralName]:
    """The SANs for `names`, each once, in the order given."""
    sans: list[x509.GeneralName] = []
    for name in names:
        san = subject_alt_name(name)
        if san not in sans:
            sans.append(san)
    return sans


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _check_days(days: int) -> None:
    if not 1 <= days <= MAX_DAYS:
        raise CertError(f"--days {days}: give a validity between 1 and {MAX_DAYS} days")


def _builder(subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey,
             days: int) -> x509.CertificateBuilder:
    _check_days(days)
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE).not_valid_after(now + datetime.timedelta(days))
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False))


def new_ca(common_name: str = "dtfm cluster CA", days: int = CA_DAYS) -> Signed:
    """A self-signed CA that may sign node certificates only (path length 0)."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (_builder(_name(common_name), _name(common_name), key, days)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return Signed(key, cert)


def new_node(ca: Signed, common_name: str, names: Sequence[str],
             days: int = NODE_DAYS) -> Signed:
    """A node certificate signed by `ca` for `common_name` and `names` (host names become
    DNS SANs, addresses IP SANs), usable as a TLS server and as a TLS client."""
    sans = subject_alt_names([common_name, *names])
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (_builder(_name(common_name), ca.cert.subject, key, days)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, key_encipherment=False, key_agreement=False,
                content_commitment=False, data_encipherment=False, key_cert_sign=False,
                crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca.key.public_key()), critical=False)
            .sign(ca.key, hashes.SHA256()))
    return Signed(key, cert)


def _refuse_overwrite(paths: Sequence[Path], force: bool) -> None:
    existing = [str(p) for p in paths if p.exists()]
    if existing and not force:
        verb = "exists" if len(existing) == 1 else "exist"
        raise CertError(f"{' and '.join(existing)} already {verb}: pass --force to replace "
                        "(everything signed by or for the old files stops being trusted), "
                        "or choose another --out")


def _make_dir(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CertError(f"cannot create --out directory {directory}: {exc.strerror}") from exc
    if not os.access(directory, os.W_OK):
        raise CertError(f"--out directory {directory} is not writable: run as its owner or "
                        "choose another --out")


def write(signed: Signed, cert_path: Path, key_path: Path, force: bool = False) -> None:
    """Write the certificate (`0644`) and its key (`0600`); refuse to replace either unless
    `force`."""
    _refuse_overwrite([cert_path, key_path], force)
    _make_dir(cert_path.parent)
    write_private(key_path, signed.key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    cert_path.write_bytes(signed.cert.public_bytes(serialization.Encoding.PEM))
    cert_path.chmod(PUBLIC_MODE)


def write_ca(directory: Path, ca: Signed, force: bool = False) -> tuple[Path, Path]:
    """`ca.pem` and `ca.key` in `directory`."""
    paths = directory / CA_CERT, directory / CA_KEY
    write(ca, *paths, force=force)
    return paths


def write_node(directory: Path, node: Signed, force: bool = False) -> tuple[Path, Path]:
    """`node.pem` and `node.key` in `directory`."""
    paths = directory / NODE_CERT, directory / NODE_KEY
    write(node, *paths, force=force)
    return paths


def load_ca(directory: Path) -> Signed:
    """The CA in `directory` (`ca.pem` and `ca.key`, as `write_ca` leaves them)."""
    cert_path, key_path = directory / CA_CERT, directory / CA_KEY
    if not directory.is_dir():
        raise CertError(f"--ca-dir {directory} is not a directory: make a CA there first with "
                        f"`coordinator certs ca --out {directory}`")
    for path in (cert_path, key_path):
        if not path.is_file():
            raise CertError(f"--ca-dir {directory} has no {path.name}: it needs the {CA_CERT} "
                            f"and {CA_KEY} that `coordinator certs ca --out {directory}` "
                            "writes (sign on the machine that holds the CA's key)")
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (ValueError, TypeError, OSError) as exc:
        raise CertError(f"cannot read the CA in --ca-dir {directory}: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
        raise CertError(f"{key_path} is not the key of {cert_path}: copy both from the same "
                        "`coordinator certs ca` run")
    return Signed(key, cert)

