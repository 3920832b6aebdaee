"""Structured logs: one JSON object per line, with the call's `extra` fields."""

from __future__ import annotations

import json
import logging

from duplexd.logs import JsonFormatter


def test_a_json_line_carries_the_message_and_its_fields() -> None:
    record = logging.LogRecord("duplexd.transport.server", logging.INFO, "f.py", 1, "session %s started", ("ab",), None)
    record.__dict__.update({"event": "session.started", "session": "ab", "sessions": 3})
    line = json.loads(JsonFormatter().format(record))
    assert line["msg"] == "session ab started" and line["level"] == "info"
    assert line["logger"] == "duplexd.transport.server" and line["t"].endswith("Z")
    assert line["event"] == "session.started" and line["session"] == "ab" and line["sessions"] == 3
    assert "args" not in line and "pathname" not in line  # only the record's own fields, not LogRecord's


def test_exceptions_are_one_field_of_the_same_line() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        record = logging.LogRecord("x", logging.ERROR, "f.py", 1, "failed", (), sys.exc_info())
    line = json.loads(JsonFormatter().format(record))
    assert "ValueError: boom" in line["exc"] and line["msg"] == "failed"
