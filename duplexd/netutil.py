"""Small network helpers for the processes that start and watch duplexd servers (`duplexd cluster`, the
benchmarks): a free port, a JSON GET, and `/healthz` once the models are loaded."""

from __future__ import annotations

import json
import socket
import urllib.request
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def http_json(url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.loads(r.read())


class StillLoading(ConnectionError):
    """The server answers, but is still loading its models (`/healthz` status `loading`)."""


def ready_health(url: str) -> dict[str, Any]:
    """`/healthz` of a server that has loaded its models; `StillLoading` (an OSError) while it loads."""
    body = http_json(url)
    if body.get("status") == "loading":
        raise StillLoading(f"{url}: loading")
    return body
