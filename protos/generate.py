"""Regenerate the committed Python stubs from the `.proto` files.

Run from the repository root: `python -m protos.generate` (needs grpcio-tools, in the `test`
extra). `--check` regenerates into a temporary folder and exits 1 when the committed stubs
differ, which is what the staleness test runs.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos" / "dtfm" / "v1"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_root: Path) -> list[Path]:
    """Run protoc over every .proto into `out_root`, returning the generated files."""
    from grpc_tools import protoc  # imported here: only needed by developers

    protos = sorted(p.relative_to(ROOT).as_posix() for p in PROTO_DIR.glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {protos}")
    return sorted((out_root / "protos" / "dtfm" / "v1").glob("*_pb2*"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if committed stubs are stale")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        generated = generate(Path(tmp))
        stale = []
        for path in generated:
            target = PROTO_DIR / path.name
            if args.check:
                if not target.exists() or not filecmp.cmp(path, target, shallow=False):
                    stale.append(path.name)
            else:
                shutil.copyfile(path, target)
        if args.check:
            committed = {p.name for p in PROTO_DIR.iterdir() if p.name.endswith(SUFFIXES)}
            stale += sorted(committed - {p.name for p in generated})
            if stale:
                print(
                    f"stale generated stubs: {', '.join(stale)}; run `python -m protos.generate`",
                    file=sys.stderr,
                )
                return 1
            print("generated stubs are up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
