"""A burst of simultaneous WebSocket handshakes against a real `duplexd serve` on a busy machine: every one
gets an HTTP answer (101, or a refusal that says when to come back), none is closed unanswered; past the
handshake, sessions over the limit are refused with 1013 and a retry hint."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from duplexd.bench.server import server_process
from duplexd.netutil import http_json

pytestmark = pytest.mark.slow

BURST = 48  # > max_connections_per_ip (32): the rest must be refused with a hint, not dropped
MAX_SESSIONS = 8


@dataclass(frozen=True, slots=True)
class Answer:
    status: int | None  # None: the connection closed (or stalled) without an HTTP status line
    headers: dict[str, str]
    body: bytes
    session: dict[str, object] | None = None  # after a 101: the server's answer to session.start


async def handshake(port: int, start: asyncio.Event) -> Answer:
    """One raw client: connect, wait for the others, send the upgrade request, read the answer; after a
    101 ask for a session (transcription only)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        await start.wait()
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write(
            (
                f"GET /v1/stream HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            return Answer(None, {}, b"")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines if line)}
        status = int(status_line.split()[1])
        if status != 101:
            return Answer(status, headers, await reader.readexactly(int(headers.get("content-length", "0"))))
        writer.write(_masked_text(json.dumps({"type": "session.start", "version": 1, "sample_rate": 16000})))
        return Answer(status, headers, b"", json.loads(await asyncio.wait_for(_read_text(reader), 30)))
    finally:
        writer.close()


def _masked_text(text: str) -> bytes:
    """A client's text frame (FIN, masked), payload < 126 bytes."""
    payload, mask = text.encode(), os.urandom(4)
    assert len(payload) < 126
    return bytes([0x81, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


async def _read_text(reader: asyncio.StreamReader) -> str:
    """The server's first text frame (unmasked; 7- or 16-bit length)."""
    first, second = await reader.readexactly(2)
    assert first == 0x81, hex(first)
    size = second & 0x7F
    if size == 126:
        size = int.from_bytes(await reader.readexactly(2), "big")
    return (await reader.readexactly(size)).decode()


@contextlib.contextmanager
def busy_cpus() -> Iterator[None]:
    """Every core kept busy by spinning processes."""
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(max(2, os.cpu_count() or 2))
    ]
    try:
        yield
    finally:
        for p in spinners:
            p.kill()
            p.wait()


async def burst(port: int, n: int) -> list[Answer]:
    start = asyncio.Event()
    clients = [asyncio.create_task(handshake(port, start)) for _ in range(n)]
    await asyncio.sleep(0.5)  # every TCP connection open first: the requests then arrive together
    start.set()
    return await asyncio.gather(*clients)


def wait_ready(port: int, timeout_s: float = 300.0) -> None:
    """Until `/readyz` says 200 (the port answers 503 "loading" while the models load)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            http_json(f"http://127.0.0.1:{port}/readyz")
            return
        except OSError:
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.5)


def test_every_handshake_of_a_burst_gets_an_http_answer() -> None:
    settings = {"dialog.enabled": "false", "transport.max_sessions": str(MAX_SESSIONS)}
    with server_process(settings=settings) as port:
        wait_ready(port)
        with busy_cpus():
            answers = asyncio.run(burst(port, BURST))
    statuses = Counter(a.status for a in answers)
    assert None not in statuses, f"handshakes closed without an HTTP answer: {statuses}"
    assert set(statuses) == {101, 429}, statuses  # (32 connections per address by default)
    assert statuses[101] + statuses[429] == BURST, statuses
    for refusal in (a for a in answers if a.status == 429):  # refused at the handshake: when to come back
        assert refusal.headers.get("retry-after", "").isdigit(), refusal.headers
        assert json.loads(refusal.body)["error"]["retry_after_ms"] > 0
    sessions = Counter(str(a.session["type"]) for a in answers if a.session is not None)
    assert sessions["session.started"] == MAX_SESSIONS and sum(sessions.values()) == statuses[101], sessions
    for a in answers:  # refused past the handshake: 1013 `overloaded` with the hint
        if a.session is not None and a.session["type"] == "error":
            assert a.session["code"] == "overloaded" and a.session["retry_after_ms"] > 0, a.session
