"""Regenerate the Python stubs of protos/pdserve/v1/*.proto.

    python protos/generate.py            # writes next to the .proto files
    python protos/generate.py --out DIR  # writes under DIR (the drift test uses this)

protoc runs from the repository root with `-I .`, so the stubs import each other as
`protos.pdserve.v1.xxx_pb2` and never clash with the `pdserve` Python package.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = Path("protos/pdserve/v1")


def proto_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / PROTO_DIR).glob("*.proto"))


def generate(out: Path = ROOT) -> list[Path]:
    """Run grpc_tools.protoc; return the generated files (relative to `out`)."""
    from grpc_tools import protoc  # imported here: only needed to regenerate
    import importlib.resources

    out.mkdir(parents=True, exist_ok=True)
    include = str(importlib.resources.files("grpc_tools") / "_proto")
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out}",
            f"--pyi_out={out}", f"--grpc_python_out={out}",
            *[str(ROOT / f) for f in proto_files()]]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted(p.relative_to(out) for p in (out / PROTO_DIR).glob("*_pb2*.py*"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT)
    args = ap.parse_args(argv)
    for f in generate(args.out):
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
