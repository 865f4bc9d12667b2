"""Generated gRPC stubs for proto/rpc/worker.proto (``python -m rpc.generate`` rewrites them).

A test regenerates them and compares, so they cannot drift from the .proto.
"""
