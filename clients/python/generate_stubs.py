"""Regenerates the checked-in gRPC stubs (src/dedupd/_proto) from
proto/dedup/v1/dedup.proto with grpcio-tools (no system protoc), or with
--check verifies the checked-in ones are what it would generate.

    python generate_stubs.py [--check]      # needs grpcio-tools==1.85.1
"""

from __future__ import annotations

import filecmp
import pathlib
import sys
import tempfile

import grpc_tools
from grpc_tools import protoc

HERE = pathlib.Path(__file__).resolve().parent
PROTO_ROOT = HERE.parents[1] / "proto"
GENERATED = ("dedup_pb2.py", "dedup_pb2.pyi", "dedup_pb2_grpc.py")


def generate(out: pathlib.Path) -> None:
    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    # The virtual path puts the stubs inside the package (their imports say
    # dedupd._proto...), so nothing is pushed onto sys.path.
    code = protoc.main([
        "grpc_tools.protoc",
        f"-Idedupd/_proto={PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        str(PROTO_ROOT / "dedup" / "v1" / "dedup.proto"),
    ])
    if code != 0:
        sys.exit(f"protoc failed ({code})")


def main() -> None:
    checked_in = HERE / "src" / "dedupd" / "_proto" / "dedup" / "v1"
    if "--check" not in sys.argv:
        generate(HERE / "src")
        return
    with tempfile.TemporaryDirectory() as scratch:
        generate(pathlib.Path(scratch))
        fresh = pathlib.Path(scratch) / "dedupd" / "_proto" / "dedup" / "v1"
        stale = [name for name in GENERATED if not filecmp.cmp(fresh / name, checked_in / name, shallow=False)]
    if stale:
        sys.exit(f"stale stubs in {checked_in}: {', '.join(stale)}; run python clients/python/generate_stubs.py")
    print("python stubs match proto/dedup/v1/dedup.proto")


if __name__ == "__main__":
    main()
