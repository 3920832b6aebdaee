"""The listening socket, opened before the models load.

`duplexd serve` binds its port first, so a busy port is reported at once rather than after the models have
loaded, and while they load the port already answers: `/healthz` 200 `{"status": "loading"}`, `/readyz` and
every other route 503 with a retry hint (a balancer or a person sees the server coming up, not a refused
connection). When the server is ready it takes the same listener over (`attach`): no connection is refused
in between.

websockets reads the GET of a handshake only, and refuses a request with a body; `HttpConnection` reads a
request's body itself first (the WebRTC calls of `/v1/realtime/calls` post an SDP offer), so every route of
the port stays on this one listener.

Light on purpose: nothing here imports a model library, so the port answers while they are imported.
"""

from __future__ import annotations

import http
import json
import ssl
import time
from collections.abc import Awaitable
from typing import Any, Protocol

from websockets.asyncio.server import Server as WsServer
from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from duplexd import __version__
from duplexd.config import SecurityConfig, TransportConfig

LOADING_RETRY_S = 2
MAX_HEAD_BYTES = 16 * 1024  # a request's line and headers (websockets' own limits are of this order)
MAX_BODY_BYTES = 64 * 1024  # a request's body: an SDP offer is 2-8 KB, a session's settings a few KB


class Route(Protocol):
    def __call__(self, connection: ServerConnection, request: Request) -> Response | Awaitable[Response] | None: ...


class Handler(Protocol):
    async def __call__(self, ws: ServerConnection) -> None: ...


def tls_context(security: SecurityConfig) -> ssl.SSLContext | None:
    if not security.tls_cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(security.tls_cert, security.tls_key)
    return context


def response(status: http.HTTPStatus, content_type: str, body: bytes, *, retry_after_s: int | None = None) -> Response:
    headers = Headers({"Content-Type": content_type, "Content-Length": str(len(body)), "Cache-Control": "no-store"})
    if retry_after_s is not None:
        headers["Retry-After"] = str(retry_after_s)
    return Response(status.value, status.phrase, headers, body)


_LOADING_PAGE = (
    f'<!doctype html><meta charset="utf-8"><meta http-equiv="refresh" content="{LOADING_RETRY_S}">'
    "<title>duplexd</title><p>duplexd is loading its models; this page reloads by itself.</p>\n"
).encode()


class HttpConnection(ServerConnection):
    """websockets' server connection, reading a request's body itself: a request whose head declares a
    `Content-Length` is read whole (at most `MAX_BODY_BYTES`) before websockets parses the head, which it
    then gets without that header. The route finds the body in `body`; `body_too_large` when it was longer
    (nothing of it is kept). Bytes after the body are ignored: websockets answers one request, then closes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._buffer: bytearray | None = bytearray()  # the head, then the body, until they are complete
        self._head = b""
        self._length = 0
        self._rest_ignored = False
        self.body: bytes | None = None
        self.body_too_large = False

    def data_received(self, data: bytes) -> None:
        if self._rest_ignored:
            return
        if self._buffer is None:  # (a request without a body: websockets reads the connection)
            super().data_received(data)
            return
        self._buffer += data
        if not self._head:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buffer) > MAX_HEAD_BYTES:
                    self._through()  # (websockets refuses it)
                return
            original = bytes(self._buffer[: end + 4])
            head, length = _head_without_body(original)
            if length is None:
                self._through()
                return
            self._head, self._length = head, length
            del self._buffer[: end + 4]
            if length > MAX_BODY_BYTES:
                self.body_too_large = True
                self._deliver(b"")
                return
            if b"\r\nexpect: 100-continue" in original.lower() and self.transport is not None:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # (curl waits for it)
        if len(self._buffer) >= self._length:
            self._deliver(bytes(self._buffer[: self._length]))

    def _through(self) -> None:
        data, self._buffer = bytes(self._buffer or b""), None
        super().data_received(data)

    def _deliver(self, body: bytes) -> None:
        self.body = body
        self._buffer = None
        self._rest_ignored = True
        super().data_received(self._head)


def _head_without_body(head: bytes) -> tuple[bytes, int | None]:
    """`head` without its `Content-Length` and `Expect` lines, and the length it declared (None: no body,
    or a length websockets should refuse itself: not a number, or given twice)."""
    lines = head.split(b"\r\n")
    lengths = [line.split(b":", 1)[1].strip() for line in lines if line.lower().startswith(b"content-length:")]
    if len(lengths) != 1 or not lengths[0].isdigit() or int(lengths[0]) == 0:
        return head, None
    kept = [line for line in lines if not line.lower().startswith((b"content-length:", b"expect:"))]
    return b"\r\n".join(kept), int(lengths[0])


class Listener:
    """The WebSocket server on the configured port, with a route and a handler that can be swapped: it
    answers "loading" until `attach` hands it the real server's."""

    ws: WsServer

    def __init__(self) -> None:
        self._started = time.monotonic()
        self._route: Route = self._loading
        self._handler: Handler | None = None

    @classmethod
    async def open(cls, transport: TransportConfig, security: SecurityConfig) -> Listener:
        """Bind and listen (an `OSError` for a busy port or a bad address, at once)."""
        listener = cls()
        listener.ws = await serve(
            listener._handle,
            transport.host,
            transport.port,
            process_request=listener._process_request,
            create_connection=HttpConnection,
            max_size=transport.max_message_bytes,
            max_queue=16,
            server_header=f"duplexd/{__version__}",
            ssl=tls_context(security),
        )
        return listener

    @property
    def port(self) -> int:
        return self.ws.sockets[0].getsockname()[1]

    def attach(self, route: Route, handler: Handler) -> None:
        """The server is ready: its routes and WebSocket handler answer from the next request on."""
        self._route, self._handler = route, handler

    async def close(self) -> None:
        self.ws.close(close_connections=True)
        await self.ws.wait_closed()

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | Awaitable[Response] | None:
        return self._route(connection, request)

    async def _handle(self, ws: ServerConnection) -> None:
        assert self._handler is not None, "a WebSocket was accepted before the server was attached"
        await self._handler(ws)

    def _loading(self, connection: ServerConnection, request: Request) -> Response:
        path = request.path.split("?", 1)[0]
        status: dict[str, Any] = {"status": "loading", "version": __version__}
        if path == "/healthz":  # alive, not ready: a liveness probe must not restart a loading server
            status["uptime_s"] = round(time.monotonic() - self._started, 1)
            return response(http.HTTPStatus.OK, "application/json", json.dumps(status).encode())
        unavailable = http.HTTPStatus.SERVICE_UNAVAILABLE
        retry = {"retry_after_s": LOADING_RETRY_S}
        if path == "/readyz":
            body = {"ready": False, **status, "retry_after_ms": 1000 * LOADING_RETRY_S}
            return response(unavailable, "application/json", json.dumps(body).encode(), **retry)
        if path in ("/", "/index.html"):
            return response(unavailable, "text/html; charset=utf-8", _LOADING_PAGE, **retry)
        error = {"error": {"code": "loading", "message": "the server is loading its models; try again shortly"}}
        return response(unavailable, "application/json", json.dumps(error).encode(), **retry)
