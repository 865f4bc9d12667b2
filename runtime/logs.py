"""Logging for every Switchboard process: one JSON object per line, carrying the request id,
or, for a person at a terminal, one short coloured line (`TerminalFormatter`).

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

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


# ANSI colours per level (SGR codes); DIM for the time and the logger's name.
LEVEL_COLOURS = {
    logging.DEBUG: "2",
    logging.INFO: "32",
    logging.WARNING: "33",
    logging.ERROR: "31",
    logging.CRITICAL: "1;31",
}
DIM = "2"
# uvicorn logs its start and stop as "uvicorn.error", which reads as an error at a glance.
SHORT_NAMES = {"uvicorn.error": "uvicorn", "uvicorn.access": "http"}


class TerminalFormatter(logging.Formatter):
    """`12:04:05 INFO  gateway.app  message [request id]`: the time of day, the level (in
    colour), the logger, the message, and the request id when there is one."""

    def __init__(self, *, colour: bool) -> None:
        super().__init__()
        self.colour = colour

    def _paint(self, code: str, text: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.colour else text

    def format(self, record: logging.LogRecord) -> str:
        # uvicorn puts a coloured twin of its message in `color_message`.
        template = getattr(record, "color_message", None) if self.colour else None
        message = template % record.args if template and record.args else record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        request_id = getattr(record, "request_id", "-")
        parts = [
            self._paint(DIM, self.formatTime(record, "%H:%M:%S")),
            self._paint(LEVEL_COLOURS.get(record.levelno, "0"), f"{record.levelname:<7}"),
            self._paint(DIM, SHORT_NAMES.get(record.name, record.name)),
            message,
        ]
        if request_id != "-":
            parts.append(self._paint(DIM, f"[{request_id}]"))
        return " ".join(parts)


def wants_colour(stream: TextIO) -> bool:
    """Colour on a terminal unless NO_COLOR is set (no-color.org)."""
    return stream.isatty() and not os.environ.get("NO_COLOR")


def configure_logging(
    *, level: str | int = "INFO", json_lines: bool = True, stream: TextIO | None = None
) -> None:
    """Root logging to `stream` (stderr): JSON lines (default) or short lines for a terminal."""
    stream = stream or sys.stderr
    handler = logging.StreamHandler(stream)
    handler.addFilter(RequestIdFilter())
    if json_lines:
        handler.setFormatter(
            JsonFormatter(
                "{asctime}{levelname}{name}{message}{request_id}",
                style="{",
                rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
                # Not uvicorn's `color_message`: the message again, with ANSI codes.
                reserved_attrs=[*RESERVED_ATTRS, "color_message"],
            )
        )
    else:
        handler.setFormatter(TerminalFormatter(colour=wants_colour(stream)))
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
