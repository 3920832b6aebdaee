"""Small network helpers for the processes that start and watch duplexd servers (`duplexd cluster`, the
benchmarks): free ports, a JSON GET, and `/healthz` once the models are loaded."""

from __future__ import annotations

import contextlib
import json
import socket
import urllib.request
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports free now. Each socket stays bound until all are chosen: ports chosen one after
    another, each closed before the next, can come back twice (the kernel may hand out a port it has just
    had back), and two listeners of one HAProxy on one port share it without a complaint."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in sockets]


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
