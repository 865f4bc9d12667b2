"""The worker process: the gRPC service, its asyncio front to the engine thread, auth, metrics."""
