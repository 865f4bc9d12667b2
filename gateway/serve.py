"""`switchboard gateway`: the app under uvicorn, settings from the environment and flags."""

from __future__ import annotations

import argparse

from gateway.app import create_app
from gateway.settings import GatewaySettings


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    overrides = {
        name: value
        for name, value in (("host", args.host), ("port", args.port), ("model", args.model))
        if value is not None
    }
    settings = GatewaySettings(**overrides)
    app = create_app(settings)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=args.log_level,
        log_config=None,  # keep the process's logging (JSON lines with request ids)
        # Longer than clients keep idle connections (httpx and the openai client: 5 s, the
        # same as uvicorn's default), so the server never closes one a client is reusing.
        timeout_keep_alive=settings.http_keep_alive_s,
        # Ctrl-C / SIGTERM: stop accepting, let streams finish for a few seconds.
        timeout_graceful_shutdown=args.graceful_s,
    )
    return 0
