"""The committed gRPC stubs are exactly what protoc makes of proto/rpc/worker.proto."""

from pathlib import Path

from rpc.generate import ROOT, generate


def test_committed_stubs_match_the_proto(tmp_path: Path):
    generate(tmp_path)
    for name in ("worker_pb2.py", "worker_pb2_grpc.py", "worker_pb2.pyi"):
        fresh = (tmp_path / "rpc" / name).read_text()
        committed = (ROOT / "rpc" / name).read_text()
        assert committed == fresh, f"rpc/{name} is stale: run `python -m rpc.generate`"
