"""Logging for every Switchboard process: one JSON object per line, carrying the request id.

The gateway sets `REQUEST_ID` when it starts serving a request and sends the id to the
worker in `GenerateRequest.request_id`; the worker sets it for the call. A filter copies it
into every record, so `grep <id>` (or a log query) follows one request across processes.
"""

from __future__ import annotations

import contextvars
import logging
import os
import sys
from typing import TextIO

from pythonjsonlogger.json import JsonFormatter

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


def configure_logging(
    *, level: str | int = "INFO", json_lines: bool = True, stream: TextIO | None = None
) -> None:
    """Root logging to `stream` (stderr): JSON lines (default) or plain text for a terminal."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(RequestIdFilter())
    if json_lines:
        handler.setFormatter(
            JsonFormatter(
                "{asctime}{levelname}{name}{message}{request_id}",
                style="{",
                rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            )
        )
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s")
        )
    # The records carry no source location, thread or process fields (see the formats above),
    # so skip collecting them: logging's documented optimization, ~1/3 of a record's cost,
    # which the gateway pays once per request.
    logging._srcfile = None  # type: ignore[attr-defined]
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper() if isinstance(level, str) else level)


def json_lines_wanted() -> bool:
    """`SWITCHBOARD_LOG_FORMAT`: json or text; by default JSON unless stderr is a terminal."""
    wanted = os.environ.get("SWITCHBOARD_LOG_FORMAT", "auto").lower()
    return wanted == "json" or (wanted == "auto" and not sys.stderr.isatty())
