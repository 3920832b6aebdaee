"""Logging setup: human-readable lines by default, one JSON object per line with `--log-json`.

A JSON line carries the time, level, logger and message, and every `extra={...}` field the call gave,
so a log pipeline can filter on them (`session`, `limit`, `over`, ...) without parsing messages.
"""

from __future__ import annotations

import json
import logging
import time

_RESERVED = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "t": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update({k: v for k, v in record.__dict__.items() if k not in _RESERVED and not k.startswith("_")})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup(*, verbose: bool = False, json_lines: bool = False) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(
        JsonFormatter() if json_lines else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    logging.getLogger("faster_whisper").setLevel(logging.WARNING)
    logging.getLogger("websockets.server").setLevel(logging.WARNING)
    for name in ("aioice", "aiortc"):  # (WebRTC calls: every ICE check and state change at INFO)
        logging.getLogger(name).setLevel(logging.WARNING)


class Redact(logging.Filter):
    """Replaces a secret (the API key) wherever it would appear in a record's message: a key sent in a
    query string is part of the request line some loggers print."""

    def __init__(self, secret: str) -> None:
        super().__init__()
        self.secret = secret

    def filter(self, record: logging.LogRecord) -> bool:
        if self.secret:
            message = record.getMessage()
            if self.secret in message:
                record.msg, record.args = message.replace(self.secret, "[redacted]"), ()
        return True


REDACTED_LOGGERS = ("duplexd", "websockets.server", "websockets.protocol")
