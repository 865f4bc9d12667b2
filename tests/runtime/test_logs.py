"""Log lines: JSON for machines (without uvicorn's ANSI twin of the message), one short
coloured line for a person at a terminal."""

from __future__ import annotations

import io
import json
import logging

import pytest

from runtime.logs import REQUEST_ID, configure_logging


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def restore_root():
    """Root as it was after each test, and uvicorn's loggers as configure_logging expects them
    before it: a server an earlier test ran in this process (at log_level="warning", with
    uvicorn's own handlers) leaves them dropping or diverting these tests' INFO records."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    saved = []
    for name in ("uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        saved.append((logger, logger.level, logger.handlers[:], logger.propagate, logger.disabled))
        logger.setLevel(logging.NOTSET)
        logger.handlers[:], logger.propagate, logger.disabled = [], True, False
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for logger, level_, handlers_, propagate, disabled in saved:
        logger.setLevel(level_)
        logger.handlers[:], logger.propagate, logger.disabled = handlers_, propagate, disabled


def uvicorn_started() -> None:
    """The record uvicorn logs at start, handed to the root's handler directly (uvicorn run
    in this process may have set its loggers' levels and propagation)."""
    record = logging.makeLogRecord(
        {
            "name": "uvicorn.error",
            "levelno": logging.INFO,
            "levelname": "INFO",
            "msg": "Started server process [%d]",
            "args": (42,),
            "color_message": "Started server process [\x1b[36m%d\x1b[0m]",
        }
    )
    logging.getLogger().handle(record)


def test_json_lines_carry_no_colour_codes():
    stream = io.StringIO()
    configure_logging(json_lines=True, stream=stream)
    uvicorn_started()
    line = json.loads(stream.getvalue())
    assert line["message"] == "Started server process [42]"
    assert set(line) == {"time", "level", "logger", "message", "request_id"}
    assert "\x1b" not in stream.getvalue()


def test_a_terminal_gets_one_short_coloured_line(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    stream = Terminal()
    configure_logging(json_lines=False, stream=stream)
    uvicorn_started()
    token = REQUEST_ID.set("chatcmpl-abc")
    try:
        logging.getLogger("gateway.relay").warning("worker %s failed", "w1")
    finally:
        REQUEST_ID.reset(token)
    started, warned = stream.getvalue().splitlines()
    assert "\x1b[32mINFO   \x1b[0m" in started and "[\x1b[36m42\x1b[0m]" in started
    assert "\x1b[33mWARNING\x1b[0m" in warned and warned.endswith("[chatcmpl-abc]\x1b[0m")
    assert "worker w1 failed" in warned


def test_no_colour_when_asked_or_not_a_terminal(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    for stream in (Terminal(), io.StringIO()):
        configure_logging(json_lines=False, stream=stream)
        uvicorn_started()
        line = stream.getvalue().rstrip("\n")
        assert "\x1b" not in line
        assert line.endswith(" INFO    uvicorn Started server process [42]")
        monkeypatch.delenv("NO_COLOR", raising=False)
