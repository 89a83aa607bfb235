"""Regenerates the Python stubs of protos/pagoda/v1/*.proto with grpcio-tools.

    python protos/generate.py              # rewrite protos/pagoda/v1/*_pb2*.py{,i} in place
    python protos/generate.py --out DIR    # write them under DIR/pagoda/v1/ instead (the freshness test)

The stubs are committed; tests/protos/test_grpc_contract.py fails when they differ from a fresh run. Use the
grpcio-tools version pinned in pyproject.toml ([project.optional-dependencies] test) so the output
is byte-identical.
"""
import argparse
import importlib.resources
import os
import pathlib
import sys

PROTO_ROOT = pathlib.Path(__file__).resolve().parent
PROTOS = ["pagoda/v1/generation.proto"]


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Runs protoc (grpc_tools) on PROTOS, writing into out_dir; returns the written files."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *PROTOS,
    ]
    # protoc resolves the .proto paths against -I, so run it from the proto root.
    cwd = os.getcwd()
    os.chdir(PROTO_ROOT)
    try:
        rc = protoc.main(args)
    finally:
        os.chdir(cwd)
    if rc != 0:
        raise RuntimeError(f"grpc_tools.protoc failed with exit code {rc}")
    written = []
    for proto in PROTOS:
        stem = proto[: -len(".proto")]
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            written.append(out_dir / f"{stem}{suffix}")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=PROTO_ROOT, help="output root (default: protos/)")
    args = parser.parse_args(argv)
    for path in generate(args.out.resolve()):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
