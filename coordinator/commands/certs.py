"""`coordinator certs ca|node`: a cluster CA and its nodes' certificates, as files.

Owns the command's flags and messages; the certificates themselves are `dtfm.certs`'s, imported
only when the command runs (cryptography takes a quarter second to load, which every other
`coordinator` command would otherwise pay while building its parser). The
daemons' `--tls-cert/--tls-key/--tls-ca` (and `/etc/dtfm/tls/` in deploy/'s env files) take
what it writes: `node.pem`, `node.key` and the CA's `ca.pem`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dtfm import flags


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="certs_command", required=True, metavar="ca|node")
    ca = sub.add_parser("ca", help="make the cluster's CA: ca.pem (copy to every machine) and "
                        "ca.key (keep on this machine only)")
    ca.add_argument("--out", required=True, metavar="DIR", help="directory to write into")
    ca.add_argument("--name", default="dtfm cluster CA", help="the CA's common name")
    ca.add_argument("--days", type=flags.positive_count, default=None,
                    help="validity in days (default: ten years)")
    ca.add_argument("--force", action="store_true", help="replace an existing CA (every "
                    "certificate it signed stops being trusted)")

    node = sub.add_parser("node", help="sign a node certificate (node.pem, node.key) with the "
                          "CA, for a coordinator or an agent, both server and client")
    node.add_argument("--ca-dir", required=True, metavar="DIR",
                      help="where `certs ca` wrote ca.pem and ca.key")
    node.add_argument("--out", required=True, metavar="DIR", help="directory to write into "
                      "(ca.pem is copied there too, so it holds all three files a node needs)")
    node.add_argument("--name", required=True, metavar="HOST",
                      help="the node's host name (common name, and a SAN)")
    node.add_argument("--advertise", action="append", default=[], metavar="ADDR",
                      help="another name or address peers dial it at: an IP becomes an IP "
                      "SAN, a host name a DNS SAN (repeat; give what `agent start "
                      "--advertise` or the agents' `--coordinator` name)")
    node.add_argument("--days", type=flags.positive_count, default=None,
                      help="validity in days (default: 825, a little over two years)")
    node.add_argument("--force", action="store_true", help="replace existing node files")


def run(args: argparse.Namespace) -> int:
    from dtfm import certs  # cryptography loads for this command only, not for every CLI call

    out = Path(args.out)
    try:
        if args.certs_command == "ca":
            ca = certs.new_ca(args.name, args.days or certs.CA_DAYS)
            cert, key = certs.write_ca(out, ca, args.force)
            print(f"wrote {cert} (copy to every machine) and {key} (keep it here, 0600)")
            return 0
        ca = certs.load_ca(Path(args.ca_dir))
        ca_bytes = (Path(args.ca_dir) / certs.CA_CERT).read_bytes()
        ca_copy = out / certs.CA_CERT
        if ca_copy.exists() and ca_copy.read_bytes() != ca_bytes and not args.force:
            raise certs.CertError(f"{ca_copy} holds another CA: pass --force to replace it, "
                                  "or choose another --out")
        cert, key = certs.write_node(out, certs.new_node(
            ca, args.name, args.advertise, args.days or certs.NODE_DAYS), args.force)
        if not ca_copy.exists() or ca_copy.read_bytes() != ca_bytes:
            ca_copy.write_bytes(ca_bytes)
            ca_copy.chmod(certs.PUBLIC_MODE)
    except certs.CertError as exc:
        return flags.fail(str(exc))
    sans = ", ".join(str(s.value) for s in certs.subject_alt_names([args.name, *args.advertise]))
    print(f"wrote {cert} and {key} (0600) for {sans}, and {ca_copy}: pass them as "
          "--tls-cert, --tls-key and --tls-ca")
    return 0
