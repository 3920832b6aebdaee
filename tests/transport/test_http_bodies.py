"""The listener reads a request's body itself (websockets parses only a handshake's GET): the route sees the
whole body of a POST, curl's `Expect: 100-continue` is answered, an oversized body is flagged and not kept,
and WebSocket handshakes on the same port are untouched."""

from __future__ import annotations

import asyncio
import http

import pytest
from websockets.asyncio.client import connect

from duplexd.config import SecurityConfig, TransportConfig
from duplexd.transport.listener import MAX_BODY_BYTES, HttpConnection, Listener, response


@pytest.fixture
async def listener():
    seen: list[tuple[str, str, bytes | None, bool]] = []

    async def handler(ws) -> None:
        await ws.send(await ws.recv())

    def route(connection: HttpConnection, request):
        seen.append((request.method, request.path, connection.body, connection.body_too_large))
        if request.method == "GET" and request.path == "/ws":
            return None
        body = b"%d bytes" % len(connection.body or b"")
        return response(http.HTTPStatus.OK, "text/plain", body)

    lis = await Listener.open(TransportConfig(host="127.0.0.1", port=0), SecurityConfig())
    lis.attach(route, handler)
    try:
        yield lis, seen
    finally:
        await lis.close()


async def _exchange(port: int, raw: bytes, *, continue_first: bool = False) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if continue_first:  # (curl: the head, then the body once the server says go on)
            head, body = raw.split(b"\r\n\r\n", 1)
            writer.write(head + b"\r\n\r\n")
            assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(body)
        else:
            writer.write(raw)
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()


def _post(path: str, body: bytes, *extra: bytes) -> bytes:
    head = [b"POST " + path.encode() + b" HTTP/1.1", b"Host: x", b"Content-Length: %d" % len(body), *extra]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


async def test_a_posted_body_reaches_the_route_whole(listener) -> None:
    lis, seen = listener
    body = bytes(range(256)) * 40  # 10 KiB, written in pieces below
    reader, writer = await asyncio.open_connection("127.0.0.1", lis.port)
    raw = _post("/calls", body)
    for at in range(0, len(raw), 1000):
        writer.write(raw[at : at + 1000])
        await writer.drain()
        await asyncio.sleep(0.001)
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"10240 bytes")
    assert seen == [("POST", "/calls", body, False)]


async def test_expect_100_continue_is_answered(listener) -> None:
    lis, seen = listener
    answer = await _exchange(lis.port, _post("/x", b"v=0\r\n", b"Expect: 100-continue"), continue_first=True)
    assert answer.startswith(b"HTTP/1.1 200") and seen[0][2] == b"v=0\r\n"


async def test_an_oversized_body_is_flagged_and_not_kept(listener) -> None:
    lis, seen = listener
    reader, writer = await asyncio.open_connection("127.0.0.1", lis.port)
    writer.write(_post("/x", b"", b"").replace(b"Content-Length: 0", b"Content-Length: %d" % (MAX_BODY_BYTES + 1)))
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 200")
    assert seen == [("POST", "/x", b"", True)]


async def test_websockets_and_bodyless_requests_are_as_before(listener) -> None:
    lis, seen = listener
    async with connect(f"ws://127.0.0.1:{lis.port}/ws") as ws:
        await ws.send("hello")
        assert await ws.recv() == "hello"
    answer = await _exchange(lis.port, b"POST /hangup HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"0 bytes")
    assert [(m, p, b) for m, p, b, _ in seen] == [("GET", "/ws", None), ("POST", "/hangup", None)]
