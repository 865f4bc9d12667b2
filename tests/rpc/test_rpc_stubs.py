"""The committed gRPC stubs are exactly what protoc makes of proto/rpc/worker.proto.

The generator is grpcio-tools at the version locks/dev.txt pins, so a patch release upstream
changes nothing here until the lock is refreshed on purpose (then regenerate and commit).
"""

import importlib.metadata
from pathlib import Path

from rpc.generate import ROOT, generate


def test_committed_stubs_match_the_proto(tmp_path: Path):
    generate(tmp_path)
    tools = importlib.metadata.version("grpcio-tools")
    for name in ("worker_pb2.py", "worker_pb2_grpc.py", "worker_pb2.pyi"):
        fresh = (tmp_path / "rpc" / name).read_text()
        committed = (ROOT / "rpc" / name).read_text()
        assert committed == fresh, (
            f"rpc/{name} is not what grpcio-tools {tools} makes of the proto: run "
            "`python -m rpc.generate` (with the locked grpcio-tools: `make install`)"
        )
