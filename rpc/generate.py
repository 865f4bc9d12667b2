"""Regenerate the committed stubs from proto/: ``python -m rpc.generate [OUT_DIR]``."""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto" / "rpc" / "worker.proto"


def generate(out_dir: Path) -> None:
    # The include root is proto/, so generated imports read `from rpc import worker_pb2`.
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT / 'proto'}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--pyi_out={out_dir}",
        str(PROTO),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
