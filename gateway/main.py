"""`switchboard gateway`: the app under uvicorn, settings from the environment and flags."""

from __future__ import annotations

import argparse
import logging

from gateway.app import create_app
from gateway.http_server import server_config
from gateway.settings import GatewaySettings

# Successful generation requests are logged by gateway.metrics.RequestObservation, with the
# tenant, model and latency; uvicorn's access line for them would repeat it, at ~4% of the
# gateway's CPU under load. Every other request (and every error) keeps its access line.
OBSERVED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class SkipObservedSuccesses(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn's access record: (client, method, path with query, http version, status)
        args = record.args
        if isinstance(args, tuple) and len(args) == 5 and args[4] == 200:
            return str(args[2]).partition("?")[0] not in OBSERVED_PATHS
        return True


def skip_observed_access_lines() -> SkipObservedSuccesses:
    """Install the filter on uvicorn's access logger; returned so a caller can remove it."""
    skip = SkipObservedSuccesses()
    logging.getLogger("uvicorn.access").addFilter(skip)
    return skip


def run_gateway(args: argparse.Namespace) -> int:
    import uvicorn

    skip_observed_access_lines()

    flags = ("host", "port", "metrics_port", "admin_port", "model")
    overrides = {name: value for name in flags if (value := getattr(args, name, None)) is not None}
    settings = GatewaySettings(**overrides)
    app = create_app(settings)
    config = server_config(
        app,
        settings,
        log_level=args.log_level,
        log_config=None,  # keep the process's logging (JSON lines with request ids)
        # Ctrl-C / SIGTERM: stop accepting, let streams finish for a few seconds.
        timeout_graceful_shutdown=args.graceful_s,
    )
    uvicorn.Server(config).run()
    return 0
