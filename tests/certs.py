"""A throwaway certificate authority for the tests, made by dtfm's own `dtfm.certs`.

One implementation: the certificates the tests' daemons use are the kind `coordinator certs`
makes for operators, in the files `make_ca` and `make_leaf` have always returned.
"""

from __future__ import annotations

from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from dtfm import certs


def make_ca(directory: Path, name: str = "ca") -> tuple[Path, ec.EllipticCurvePrivateKey,
                                                      x509.Certificate]:
    """`{name}.pem` (and `{name}.key`) in `directory`: a CA valid for a day."""
    ca = certs.new_ca(f"dtfm test {name}", days=1)
    path = directory / f"{name}.pem"
    certs.write(ca, path, directory / f"{name}.key", force=True)
    return path, ca.key, ca.cert


def make_leaf(directory: Path, name: str, ca_key: ec.EllipticCurvePrivateKey,
              ca_cert: x509.Certificate) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1/localhost usable as both server and client."""
    leaf = certs.new_node(certs.Signed(ca_key, ca_cert), "localhost", ["127.0.0.1"], days=1)
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    certs.write(leaf, cert_path, key_path, force=True)
    return cert_path, key_path
